"""The ``quantize`` fused op: a ``Quantize`` no larger fusion took, on the implementation table.

Its output is an :class:`opfuse.fp8.Float8Activation` (FP8 bytes and scales that autograd sees as
the activation); the gradient passes through unchanged, as for the basic op.
"""

from typing import Sequence

import torch
from torch import Tensor

from ...fp8.recipe import E4M3
from ...ops import group as groups
from ...ops.base import TensorMeta
from .implementations import TABLE as implementations
from ...machinery.fused_op import FusedOp, define_fused_op
from ...machinery.implementation import CallSpec

__all__ = ["QuantizeActivation"]


def _forward(x: Tensor, dtype: str, rowwise: bool, amax_group: str, impl: str) -> Tensor:
    """Prototype: the quantized activation."""


def _fake(x, dtype, rowwise, amax_group, impl):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    pass


def _autograd(_backward_op):
    def backward(ctx, dy):
        return dy, None, None, None, None

    return backward


QUANTIZE, _ = define_fused_op("quantize", lookup=implementations.get, forward=_forward, fake=_fake,
                              setup_context=_setup, autograd=_autograd)


class QuantizeActivation(FusedOp):
    """``x`` to FP8 along its last dim (see :class:`opfuse.ops.Quantize`)."""

    name = "quantize"

    def __init__(self, *, dtype=E4M3, rowwise: bool = False, amax_group=None):
        super().__init__()
        self.dtype, self.rowwise, self.amax_group = dtype, rowwise, amax_group

    @classmethod
    def from_op(cls, op) -> "QuantizeActivation":
        return cls(dtype=op.dtype, rowwise=op.rowwise, amax_group=op.amax_group)

    def _dtype_name(self) -> str:
        return "e4m3" if self.dtype == E4M3 else "e5m2"

    def _group(self) -> str:
        return groups.group_name(self.amax_group) if self.amax_group is not None else ""

    def extra_repr(self) -> str:
        text = f"{self._dtype_name()}, scale per {'row' if self.rowwise else 'tensor'}"
        if self.amax_group is not None:
            text += f", amax over group={self._group()}"
        return text + (f", impl={self.impl}" if self.impl else "")

    def call_spec(self, metas: Sequence[TensorMeta]) -> CallSpec:
        # The amax group is an attribute, not the op's group: no peer memory is opened for it.
        return CallSpec(op=self.name, inputs={"x": metas[0]},
                        attrs={"dtype": self._dtype_name(), "rowwise": self.rowwise, "amax_group": self._group() or None},
                        requires_grad=torch.is_grad_enabled() and metas[0].requires_grad)

    def forward(self, x):
        return QUANTIZE(x, self._dtype_name(), self.rowwise, self._group(), self._impl())
