"""Base class of the modules that replace matched ops in a program.

A fused module holds references to the matched ops' parameters (shared, so optimizers and
``state_dict`` of the user's block keep working), builds a :class:`CallSpec` from its input
metadata, asks the dispatch table for an implementation when the program is compiled, and calls
its ``torch.library`` custom op with that implementation's name.
"""

from __future__ import annotations

from typing import ClassVar, Sequence

from torch import nn

from .. import dispatch
from ...ops.base import TensorMeta

__all__ = ["FusedOp"]


class FusedOp(nn.Module):
    #: Key of this op in the dispatch table.
    op_name: ClassVar[str] = ""

    def __init__(self):
        super().__init__()
        self.impl: str | None = None
        self.skipped: tuple[tuple[str, str], ...] = ()

    @property
    def kind(self) -> str:
        return type(self).__name__

    def describe(self) -> str:
        extra = self.extra_repr()
        return f"{self.kind}({extra})" if extra else self.kind

    def call_spec(self, metas: Sequence[TensorMeta]) -> dispatch.CallSpec:
        raise NotImplementedError

    def select_implementation(self, metas: Sequence[TensorMeta]) -> dispatch.Choice:
        """Choose (and remember) the implementation for inputs with ``metas``."""
        choice = dispatch.choose(self.call_spec(metas))
        self.impl = choice.name
        self.skipped = choice.skipped
        return choice

    def _impl(self) -> str:
        if self.impl is None:
            raise RuntimeError(f"{self.kind}: no implementation selected; compile the program first")
        return self.impl
