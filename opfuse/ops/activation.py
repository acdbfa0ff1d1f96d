"""Activation ops: :class:`GELU` and :class:`SwiGLU`."""

from __future__ import annotations

import torch.nn.functional as F

from .base import BasicOp, OpInputError, TensorMeta
from .sharding import Sharding, reject_partial

__all__ = ["GELU", "SwiGLU"]


class GELU(BasicOp):
    """Gaussian error linear unit; ``approximate`` is ``"none"`` (torch's default, exact erf) or
    ``"tanh"``."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate={approximate!r}; accepted: 'none', 'tanh'")
        self.approximate = approximate

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"

    def forward(self, x):
        return F.gelu(x, approximate=self.approximate)

    def propagate_sharding(self, x: Sharding, *extra) -> Sharding:
        """Elementwise; not linear, so never on a partial sum."""
        reject_partial(self, x)
        return x

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        self._require_float(x)
        return x


class SwiGLU(BasicOp):
    """``silu(a) * b`` where ``[a, b]`` are the two halves of the last dim.

    On a column-parallel activation each rank applies this to its own shard, so a sharded
    ``fc1`` must store each rank's gate rows followed by its up rows (the usual layout of
    Megatron-style checkpoints).
    """

    def forward(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def propagate_sharding(self, x: Sharding, *extra) -> Sharding:
        """Per rank on feature-sharded values (each rank's shard is ``[gate_r; up_r]``); never on
        a partial sum."""
        reject_partial(self, x)
        return x

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        self._require_float(x)
        if x.features % 2:
            raise OpInputError(
                f"SwiGLU: input has {x.features} features (shape {list(x.shape)}); expected an "
                f"even number (gate and up halves)"
            )
        return x.with_(shape=x.shape[:-1] + (x.features // 2,))
