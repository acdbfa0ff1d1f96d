"""How a value is laid out over a process group.

The partition pass annotates every graph value with a :class:`Sharding` and inserts the
collectives that the sharded-GEMM rules (``opfuse.passes.partition``) require.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Sharding", "REPLICATED"]


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Layout of an activation ``[tokens..., features]`` over ``group``.

    ``tokens``: dim 0 is split across ranks (sequence parallel); ``features``: the last dim is
    split (the output of a column-parallel GEMM); ``partial``: each rank holds a partial sum
    that still needs a reduction (the raw output of a row-parallel GEMM).
    """

    tokens: bool = False
    features: bool = False
    partial: bool = False
    group: Any = None

    @property
    def replicated(self) -> bool:
        return not (self.tokens or self.features or self.partial)

    def describe(self) -> str:
        if self.replicated:
            return "replicated"
        parts = [name for name in ("tokens", "features", "partial") if getattr(self, name)]
        return "+".join(f"{p}-sharded" if p != "partial" else "partial-sum" for p in parts)


REPLICATED = Sharding()
