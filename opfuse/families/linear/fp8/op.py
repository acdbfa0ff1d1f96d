"""``fp8_linear``: ``y = x @ W.T (+ b)`` with FP8 operands, forward and backward (the GEMMs and
operands of :mod:`opfuse.fp8.linear`).

``x`` is either an FP8 activation (a :class:`~opfuse.fp8.Float8Activation` from a norm that emits
FP8 or a ``Quantize``; its payload is passed as ``x_data`` / ``x_scale``) or a plain tensor that
the op quantizes itself. Implementations::

    forward(x, x_data | None, x_scale | None, weight, bias | None, recipe) -> (y, x_data, x_scale, x_data_t)
    backward(dy, x_data, x_scale, x_data_t, weight, recipe, need_dx, need_dw, need_db) -> (dx, dw, db)

``forward`` returns the ``x`` it quantized (empty tensors when ``x`` came quantized: outputs never
alias inputs): backward keeps the quantized ``x`` (one byte per element), not the high-precision one.
``x_data_t`` is its transposed bytes when the implementation wrote them in the same pass (one scale
per tensor, an FP8 weight gradient to come; see :func:`.reference.transposes_x`), else empty.
"""

from typing import Optional

import torch
from torch import Tensor

from ....fp8.recipe import Recipe
from ....fp8.tensor import payload
from ..implementations import TABLE as implementations
from ....machinery.fused_op import define_fused_op
from ....machinery.gemm_op import GemmFusedOp
from .reference import payload_fake

__all__ = ["Fp8Linear"]


def _forward(x: Tensor, x_data: Optional[Tensor], x_scale: Optional[Tensor], weight: Tensor, bias: Optional[Tensor],
             recipe: str, impl: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Prototype: ``(y, x_data, x_scale, x_data_t)``."""


def _fake(x, x_data, x_scale, weight, bias, recipe, impl):
    return (x.new_empty(tuple(x.shape[:-1]) + (weight.shape[0],)),) + payload_fake(x, x_data, weight, recipe, impl)


def _backward(dy: Tensor, x_data: Tensor, x_scale: Tensor, x_data_t: Tensor, weight: Tensor, recipe: str,
              need_dx: bool, need_dw: bool, need_db: bool, impl: str) -> tuple[Tensor, Tensor, Tensor]:
    """Prototype: ``(dx, dw, db)``, each empty when not needed."""


def _backward_fake(dy, x_data, x_scale, x_data_t, weight, recipe, need_dx, need_dw, need_db, impl):
    return (dy.new_empty(tuple(dy.shape[:-1]) + (weight.shape[1],)) if need_dx else dy.new_empty(0),
            torch.empty_like(weight) if need_dw else dy.new_empty(0),
            dy.new_empty(weight.shape[0]) if need_db else dy.new_empty(0))


def _setup(ctx, inputs, output):
    x, x_data, x_scale, weight, bias, recipe, impl = inputs
    _, data, scale, data_t = output
    ctx.mark_non_differentiable(data, scale, data_t)
    if x_data is not None:
        data, scale = x_data, x_scale
    ctx.save_for_backward(data, scale, data_t, weight)
    ctx.recipe, ctx.impl, ctx.has_bias, ctx.x_shape = recipe, impl, bias is not None, tuple(x.shape)


def _autograd(backward_op):
    def backward(ctx, dy, _ddata, _dscale, _ddata_t):
        data, scale, data_t, weight = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
        need_db = ctx.has_bias and ctx.needs_input_grad[4]
        dx, dw, db = backward_op(dy.contiguous(), data, scale, data_t, weight, ctx.recipe, need_dx, need_dw, need_db,
                                 ctx.impl)
        return (dx.reshape(ctx.x_shape) if need_dx else None, None, None, dw if need_dw else None,
                db if need_db else None, None, None)

    return backward


FP8_LINEAR, _ = define_fused_op(
    "fp8_linear", lookup=implementations.get, forward=_forward, fake=_fake, backward=_backward,
    backward_fake=_backward_fake, setup_context=_setup, autograd=_autograd)


class Fp8Linear(GemmFusedOp):
    """``y = x @ weight.T (+ bias)`` with FP8 operands of ``recipe``."""

    name = "fp8_linear"

    def __init__(self, *, weight, bias=None, recipe: Recipe):
        super().__init__(weight=weight, bias=bias, recipe=recipe)

    def forward(self, x):
        q = payload(x)
        y, _, _, _ = FP8_LINEAR(x, None if q is None else q.data, None if q is None else q.scale_inv, self.weight,
                             self.bias, self.recipe.key(), self._impl())
        return y
