"""``gated_activation``: ``act(gate) * up`` of a packed value ``y = [gate | up]`` (last dim ``2n``),
the layout one GEMM over ``[gate_weight; up_weight]`` produces.

Custom ops ``opfuse::gated_activation(y, activation, impl)`` and
``opfuse::gated_activation_backward(dout, y, activation, impl)``; the backward returns the
gradient of the packed value in one tensor, which is what the GEMM before it consumes (no
concatenation of two half gradients).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ...ops.activation import ACTIVATIONS
from ...ops.base import TensorMeta
from .implementations import TABLE as implementations
from ...machinery.fused_op import FusedOp, define_fused_op
from ...machinery.implementation import CallSpec

__all__ = ["PackedGatedActivation"]


def _forward(y: Tensor, activation: str, impl: str) -> Tensor:
    """Prototype."""


def _fake(y, activation, impl):
    return y.new_empty(tuple(y.shape[:-1]) + (y.shape[-1] // 2,))


def _backward(dout: Tensor, y: Tensor, activation: str, impl: str) -> Tensor:
    """Prototype: the gradient of ``y``."""


def _backward_fake(dout, y, activation, impl):
    return torch.empty_like(y)


def _setup(ctx, inputs, output):
    y, activation, impl = inputs
    ctx.save_for_backward(y)
    ctx.activation, ctx.impl = activation, impl


def _autograd(backward_op):
    def backward(ctx, dout):
        (y,) = ctx.saved_tensors
        return backward_op(dout.contiguous(), y, ctx.activation, ctx.impl), None, None

    return backward


GATED_ACTIVATION, _ = define_fused_op(
    "gated_activation", lookup=implementations.get, forward=_forward, fake=_fake, backward=_backward,
    backward_fake=_backward_fake, setup_context=_setup, autograd=_autograd)


class PackedGatedActivation(FusedOp):
    """``act(y[..., :n]) * y[..., n:]`` for ``y [..., 2n]``; ``activation`` as in
    :class:`~opfuse.ops.GatedActivation`."""

    name = "gated_activation"

    def __init__(self, activation: str):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"PackedGatedActivation: activation={activation!r}; accepted: {sorted(ACTIVATIONS)}")
        self.activation = activation

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}" + (f", impl={self.impl}" if self.impl else "")

    def call_spec(self, metas: Sequence[TensorMeta]) -> CallSpec:
        return CallSpec(op=self.name, inputs={"x": metas[0]}, attrs={"activation": self.activation},
                        requires_grad=torch.is_grad_enabled() and metas[0].requires_grad)

    def forward(self, y):
        return GATED_ACTIVATION(y, self.activation, self._impl())
