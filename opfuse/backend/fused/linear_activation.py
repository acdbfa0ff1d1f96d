"""``BasicLinear -> Bias -> GELU`` as one op: ``y = gelu(x @ w.T + b)``.

On CUDA with ``approximate="tanh"`` and no gradient, cuBLASLt applies bias and GELU in the GEMM
epilogue (``torch._addmm_activation``), so the pre-activation never goes to memory. Otherwise
the reference runs ``addmm`` then ``gelu`` and keeps the pre-activation for backward, as the
unfused ops would.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ...ops.base import TensorMeta
from ...ops.norm import compute_dtype
from .. import dispatch
from .base import FusedCall, FusedOp

__all__ = ["LinearBiasActivation", "reference_forward", "reference_backward", "cublaslt_forward", "cublaslt_check"]

_ACTIVATIONS = {"gelu": "none", "gelu_tanh": "tanh"}


def _approximate(activation: str) -> str:
    try:
        return _ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(f"linear_bias_activation: activation={activation!r}; accepted: {sorted(_ACTIVATIONS)}") from None


def reference_forward(x, weight, bias, *, activation, save_pre):
    pre = F.linear(x, weight, bias)
    y = F.gelu(pre, approximate=_approximate(activation))
    return y, (pre if save_pre else x.new_empty(0))


def reference_backward(dy, x, weight, pre, *, activation):
    dpre = torch.ops.aten.gelu_backward(dy, pre, approximate=_approximate(activation))
    rows = dpre.reshape(-1, dpre.shape[-1])
    dx = F.linear(dpre, weight.t())
    dw = rows.t().mm(x.reshape(-1, x.shape[-1]))
    db = rows.sum(0, dtype=compute_dtype(dy.dtype)).to(dy.dtype)
    return dx, dw, db


def cublaslt_check(spec: dispatch.CallSpec) -> str | None:
    if spec.device.type != "cuda":
        return "needs a CUDA device"
    if spec.attrs["activation"] != "gelu_tanh":
        return "the cuBLASLt GELU epilogue is the tanh approximation; exact GELU uses the reference"
    if spec.requires_grad:
        return "training needs the pre-activation, which the epilogue does not return"
    if spec.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {spec.dtype} not supported by cuBLASLt epilogues"
    return None


def cublaslt_forward(x, weight, bias, *, activation, save_pre):
    rows = x.reshape(-1, x.shape[-1])
    y = torch._addmm_activation(bias, rows, weight.t(), use_gelu=True)
    return y.reshape(x.shape[:-1] + (weight.shape[0],)), x.new_empty(0)


def _linear_bias_activation(x: Tensor, weight: Tensor, bias: Tensor, activation: str, impl: str,
                            save_pre: bool) -> tuple[Tensor, Tensor]:
    return dispatch.get("linear_bias_activation", impl).forward(x, weight, bias, activation=activation,
                                                                save_pre=save_pre)


def _linear_bias_activation_fake(x, weight, bias, activation, impl, save_pre):
    shape = tuple(x.shape[:-1]) + (weight.shape[0],)
    return x.new_empty(shape), (x.new_empty(shape) if save_pre else x.new_empty(0))


def _linear_bias_activation_backward(dy: Tensor, x: Tensor, weight: Tensor, pre: Tensor, activation: str,
                                     impl: str) -> tuple[Tensor, Tensor, Tensor]:
    chosen = dispatch.get("linear_bias_activation", impl)
    return (chosen.backward or reference_backward)(dy, x, weight, pre, activation=activation)


LINEAR_BIAS_ACTIVATION_BACKWARD = FusedCall(
    "opfuse::linear_bias_activation_backward", _linear_bias_activation_backward,
    lambda dy, x, weight, pre, activation, impl: (torch.empty_like(x), torch.empty_like(weight),
                                                  dy.new_empty(weight.shape[0])))


def _setup(ctx, inputs, output):
    x, weight, bias, activation, impl, save_pre = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.activation, ctx.impl = activation, impl


def _backward(ctx, dy, _dpre):
    x, weight, pre = ctx.saved_tensors
    if pre.numel() == 0:
        raise RuntimeError("opfuse linear_bias_activation backward: the pre-activation was not kept; the program "
                           "was compiled for inputs that did not require grad")
    dx, dw, db = LINEAR_BIAS_ACTIVATION_BACKWARD(dy.contiguous(), x, weight, pre, ctx.activation, ctx.impl)
    return dx, dw, db, None, None, None


LINEAR_BIAS_ACTIVATION = FusedCall("opfuse::linear_bias_activation", _linear_bias_activation,
                                   _linear_bias_activation_fake, _setup, _backward)


class LinearBiasActivation(FusedOp):
    """``y = gelu(x @ weight.T + bias)``."""

    op_name = "linear_bias_activation"

    def __init__(self, *, weight, bias, approximate: str = "none"):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.activation = "gelu_tanh" if approximate == "tanh" else "gelu"
        self.save_pre = True

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return f"in={inp}, out={out}, activation={self.activation}" + (f", impl={self.impl}" if self.impl else "")

    def call_spec(self, metas: Sequence[TensorMeta]) -> dispatch.CallSpec:
        requires_grad = torch.is_grad_enabled() and (
            metas[0].requires_grad or self.weight.requires_grad or self.bias.requires_grad)
        self.save_pre = requires_grad
        return dispatch.CallSpec(
            op=self.op_name,
            inputs={"x": metas[0], "weight": TensorMeta.of(self.weight), "bias": TensorMeta.of(self.bias)},
            attrs={"activation": self.activation},
            requires_grad=requires_grad,
        )

    def forward(self, x):
        y, _pre = LINEAR_BIAS_ACTIVATION(x, self.weight, self.bias, self.activation, self._impl(), self.save_pre)
        return y
