"""Activation ops: :class:`GELU`, :class:`SwiGLU` and :class:`GatedActivation`."""

from __future__ import annotations

import torch.nn.functional as F

from .base import BasicOp, OpInputError, PartitionError, TensorMeta, check_meta_equal
from .sharding import Sharding, reject_partial

__all__ = ["GELU", "SwiGLU", "GatedActivation", "ACTIVATIONS"]

#: Activations of gated layers: name -> function.
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


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

    Only on values whose features are whole: halving a column-parallel shard pairs the wrong
    features unless every rank's rows were stored as ``[gate_r; up_r]``, which a loaded
    ``torch.cat([gate, up])`` is not. A tensor-parallel gated MLP uses :class:`GatedLinear`
    (separate gate and up weights), which computes this activation itself.
    """

    def forward(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def propagate_sharding(self, x: Sharding, *extra) -> Sharding:
        """Whole features only (see the class docstring); never a partial sum."""
        reject_partial(self, x)
        if x.features:
            raise PartitionError(
                f"{self.describe()}: its input is sharded on features (a column-parallel layer's output), so each "
                f"rank would split its own shard into gate and up halves; a column Linear loaded with "
                f"torch.cat([gate, up]) gives wrong results that way at world >= 2. Use "
                f"ops.GatedLinear(in_features, ffn, parallel='column', activation='silu') in place of "
                f"Linear(in_features, 2 * ffn, parallel='column') + SwiGLU(), and load it with "
                f"load_unsharded(gate=..., up=...)")
        return x

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        self._require_float(x)
        if x.features % 2:
            raise OpInputError(
                f"SwiGLU: input has {x.features} features (shape {list(x.shape)}); expected an "
                f"even number (gate and up halves)"
            )
        return x.with_(shape=x.shape[:-1] + (x.features // 2,))


class GatedActivation(BasicOp):
    """``act(gate) * up`` of two values of the same shape: the main input ``gate`` and one extra
    input ``up`` (in a ``Sequential``, the next extra input; in :class:`GatedLinear`, the up
    projection). ``activation`` is ``"silu"`` (SwiGLU), ``"gelu"`` or ``"gelu_tanh"`` (GeGLU).
    """

    num_extra_inputs = 1

    def __init__(self, activation: str = "silu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"GatedActivation: activation={activation!r}; accepted: {', '.join(map(repr, ACTIVATIONS))}")
        self.activation = activation

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"

    def forward(self, gate, up):
        return ACTIVATIONS[self.activation](gate) * up

    def propagate_sharding(self, x: Sharding, *extra: Sharding) -> Sharding:
        """Elementwise over two values laid out alike; never a partial sum."""
        reject_partial(self, x)
        if extra and extra[0] != x:
            raise PartitionError(f"{self.describe()}: gate is {x.describe()} but up is {extra[0].describe()}; "
                                 f"both must be laid out alike")
        return x

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        self._require_float(x, "gate")
        (up,) = extra
        check_meta_equal(self, "up", up, x)
        return x.with_(requires_grad=x.requires_grad or up.requires_grad)
