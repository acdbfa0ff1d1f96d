"""``BasicLinear -> Bias -> GELU`` as one fused op, ``linear_bias_activation``:
``y = gelu(x @ w.T + b)``; the pre-activation is kept for backward when gradients are needed."""

from typing import Sequence

import torch
from torch import Tensor

from ...ops.base import TensorMeta
from .implementations import TABLE as implementations
from ...machinery.fused_op import FusedOp, define_fused_op
from ...machinery.implementation import CallSpec

__all__ = ["LinearBiasActivation"]


def _forward(x: Tensor, weight: Tensor, bias: Tensor, activation: str, save_pre: bool,
             impl: str) -> tuple[Tensor, Tensor]:
    """Prototype: ``(y, pre-activation or empty)``."""


def _fake(x, weight, bias, activation, save_pre, impl):
    shape = tuple(x.shape[:-1]) + (weight.shape[0],)
    return x.new_empty(shape), (x.new_empty(shape) if save_pre else x.new_empty(0))


def _backward(dy: Tensor, x: Tensor, weight: Tensor, pre: Tensor, activation: str,
              impl: str) -> tuple[Tensor, Tensor, Tensor]:
    """Prototype: ``(dx, dw, db)``."""


def _backward_fake(dy, x, weight, pre, activation, impl):
    return torch.empty_like(x), torch.empty_like(weight), dy.new_empty(weight.shape[0])


def _setup(ctx, inputs, output):
    x, weight, bias, activation, save_pre, impl = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.activation, ctx.impl = activation, impl


def _autograd(backward_op):
    def backward(ctx, dy, _dpre):
        x, weight, pre = ctx.saved_tensors
        if pre.numel() == 0 and dy.numel() != 0:
            raise RuntimeError("opfuse linear_bias_activation backward: the pre-activation was not kept; the "
                               "program was compiled for inputs that did not require grad")
        dx, dw, db = backward_op(dy.contiguous(), x, weight, pre, ctx.activation, ctx.impl)
        return dx, dw, db, None, None, None

    return backward


LINEAR_BIAS_ACTIVATION, _ = define_fused_op(
    "linear_bias_activation", lookup=implementations.get, forward=_forward, fake=_fake, backward=_backward,
    backward_fake=_backward_fake, setup_context=_setup, autograd=_autograd)


class LinearBiasActivation(FusedOp):
    """``y = gelu(x @ weight.T + bias)``."""

    name = "linear_bias_activation"
    reference_is_unfused = True  # addmm then GELU: what the model wrote

    def __init__(self, *, weight, bias, approximate: str = "none"):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.activation = "gelu_tanh" if approximate == "tanh" else "gelu"
        self.save_pre = True

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return f"in={inp}, out={out}, activation={self.activation}" + (f", impl={self.impl}" if self.impl else "")

    def call_spec(self, metas: Sequence[TensorMeta]) -> CallSpec:
        requires_grad = torch.is_grad_enabled() and (
            metas[0].requires_grad or self.weight.requires_grad or self.bias.requires_grad)
        self.save_pre = requires_grad
        return CallSpec(
            op=self.name,
            inputs={"x": metas[0], "weight": TensorMeta.of(self.weight), "bias": TensorMeta.of(self.bias)},
            attrs={"activation": self.activation},
            requires_grad=requires_grad,
        )

    def forward(self, x):
        y, _pre = LINEAR_BIAS_ACTIVATION(x, self.weight, self.bias, self.activation, self.save_pre, self._impl())
        return y
