"""The FP8 collective GEMMs: :class:`AllGatherLinearFp8` (``all_gather_linear_fp8``: a
sequence-parallel column layer whose token all-gather moves FP8 bytes) and
:class:`LinearReduceScatterFp8` (``linear_reduce_scatter_fp8``: a row layer's FP8 GEMM and the
reduce-scatter of its partial sums, in the activation dtype; bias after the reduction).

``x`` is an FP8 activation (its payload passed as ``x_data`` / ``x_scale``) or a plain tensor the op
quantizes: for the all-gather, with one scale per tensor shared by the group's ranks (the amax is
all-reduced) or one per row. Implementations::

    forward(x, x_data | None, x_scale | None, weight, bias | None, group, recipe) -> (y, x_data, x_scale, x_data_t)
    backward(dy, x_data, x_scale, x_data_t, weight, group, recipe, need_dx, need_dw, need_db) -> (dx, dw, db)

``forward`` returns this rank's quantized ``x`` when it quantized it (empty tensors otherwise): what
backward keeps, one byte per element; ``x_data_t`` as for ``fp8_linear`` (the reduce-scatter op's
GPU implementation writes it; the all-gather's backward transposes the gathered ``x`` instead).
"""

from typing import Optional

import torch
from torch import Tensor

from ....fp8.recipe import Recipe
from ....fp8.tensor import payload
from ....ops import group as groups
from ..implementations import TABLE as implementations
from ...linear.fp8.reference import payload_fake
from ....machinery.fused_op import define_fused_op
from ....machinery.gemm_op import GemmFusedOp

__all__ = ["AllGatherLinearFp8", "LinearReduceScatterFp8"]


def _forward(x: Tensor, x_data: Optional[Tensor], x_scale: Optional[Tensor], weight: Tensor, bias: Optional[Tensor],
             group: str, recipe: str, impl: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Prototype: ``(y, x_data, x_scale, x_data_t)``."""


def _backward(dy: Tensor, x_data: Tensor, x_scale: Tensor, x_data_t: Tensor, weight: Tensor, group: str, recipe: str,
              need_dx: bool, need_dw: bool, need_db: bool, impl: str) -> tuple[Tensor, Tensor, Tensor]:
    """Prototype: ``(dx, dw, db)``, each empty when not needed."""


def _fake(tokens_factor):
    def fake(x, x_data, x_scale, weight, bias, group, recipe, impl):
        world = groups.world_size(groups.from_name(group))
        rows = x.shape[0] * world if tokens_factor > 0 else x.shape[0] // world
        y = x.new_empty((rows,) + tuple(x.shape[1:-1]) + (weight.shape[0],))
        # Only the reduce-scatter op's GPU implementation writes the transposed bytes.
        return (y,) + payload_fake(x, x_data, weight, recipe, impl if tokens_factor < 0 else "reference")

    return fake


def _backward_fake(dy, x_data, x_scale, x_data_t, weight, group, recipe, need_dx, need_dw, need_db, impl):
    return (x_data.new_empty(x_data.shape, dtype=dy.dtype) if need_dx else dy.new_empty(0),
            torch.empty_like(weight) if need_dw else dy.new_empty(0),
            dy.new_empty(weight.shape[0]) if need_db else dy.new_empty(0))


def _setup(ctx, inputs, output):
    x, x_data, x_scale, weight, bias, group, recipe, impl = inputs
    _, data, scale, data_t = output
    ctx.mark_non_differentiable(data, scale, data_t)
    if x_data is not None:
        data, scale = x_data, x_scale
    ctx.save_for_backward(data, scale, data_t, weight)
    ctx.group, ctx.recipe, ctx.impl, ctx.has_bias = group, recipe, impl, bias is not None


def _autograd(backward_op):
    def backward(ctx, dy, _ddata, _dscale, _ddata_t):
        data, scale, data_t, weight = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[3]
        need_db = ctx.has_bias and ctx.needs_input_grad[4]
        dx, dw, db = backward_op(dy.contiguous(), data, scale, data_t, weight, ctx.group, ctx.recipe, need_dx, need_dw,
                                 need_db, ctx.impl)
        return dx if need_dx else None, None, None, dw if need_dw else None, db if need_db else None, None, None, None

    return backward


def _define(name: str, tokens_factor: int):
    forward_op, _ = define_fused_op(name, lookup=implementations.get, forward=_forward, fake=_fake(tokens_factor),
                                    backward=_backward, backward_fake=_backward_fake, setup_context=_setup,
                                    autograd=_autograd)
    return forward_op


AG_LINEAR_FP8 = _define("all_gather_linear_fp8", +1)
LINEAR_RS_FP8 = _define("linear_reduce_scatter_fp8", -1)


class _CollectiveLinearFp8(GemmFusedOp):
    collective = True
    custom_op = None

    def __init__(self, *, weight, bias=None, group=None, recipe: Recipe):
        super().__init__(weight=weight, bias=bias, group=group, recipe=recipe)

    def forward(self, x):
        q = payload(x)
        y, _, _, _ = self.custom_op(x, None if q is None else q.data, None if q is None else q.scale_inv, self.weight,
                                 self.bias, groups.group_name(self.group), self.recipe.key(), self._impl())
        return y


class AllGatherLinearFp8(_CollectiveLinearFp8):
    """``y = all_gather_tokens(fp8(x)) @ fp8(weight).T [+ bias]``: the gather moves FP8 bytes."""

    name = "all_gather_linear_fp8"
    custom_op = staticmethod(AG_LINEAR_FP8)


class LinearReduceScatterFp8(_CollectiveLinearFp8):
    """``y = reduce_scatter_tokens(fp8(x) @ fp8(weight).T) [+ bias]`` (the sum in the activation dtype,
    the bias once after it)."""

    name = "linear_reduce_scatter_fp8"
    custom_op = staticmethod(LINEAR_RS_FP8)
