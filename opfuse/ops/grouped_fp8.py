"""The FP8 reference of ``BasicGroupedLinear`` (under :func:`opfuse.fp8.autocast`): the weight
operand quantized where it lives and, under FSDP, all-gathered as FP8 bytes and per-row scales
(:func:`fp8_grouped_weight`), and the emulated grouped GEMMs with their gradients
(:class:`Fp8GroupedFn`). Torch ops and ``torch.distributed`` only: what the FP8 implementations of
``grouped_linear_fp8`` are tested against."""

from __future__ import annotations

import torch

from ..fp8 import grouped as fp8_grouped
from ..fp8.numerics import Quantized
from ..fp8.recipe import Recipe
from . import collectives as coll
from . import group as groups

__all__ = ["fp8_grouped_weight", "Fp8GroupedFn"]


def fp8_grouped_weight(weight: torch.Tensor, num_groups: int, out_features: int, recipe: Recipe,
                       fsdp_group=None) -> Quantized:
    """The grouped GEMM's FP8 weight operand (``data [G, N, K]``, ``scale_inv [G, N]``) from this rank's
    parameter: the whole ``[G, N, K]`` weight, or (``fsdp_group``) its shard of ``[G * N, K]`` rows,
    quantized here and all-gathered as FP8 bytes and per-row scales (half the bytes of a bfloat16
    gather). Reference implementation (torch ops, ``torch.distributed``)."""
    k = weight.shape[-1]
    if fsdp_group is None:
        q = fp8_grouped.weight_rows_operand(weight.reshape(-1, k), 0, out_features, num_groups, recipe)
        return Quantized(q.data.view(num_groups, out_features, k), q.scale_inv.view(num_groups, out_features))
    pg = groups.resolve(fsdp_group)
    world = groups.world_size(pg)

    def reduce_amax(a):
        if world > 1:
            torch.distributed.all_reduce(a, op=torch.distributed.ReduceOp.MAX, group=pg)

    first = groups.rank(pg) * weight.shape[0]
    q = fp8_grouped.weight_rows_operand(weight, first, out_features, num_groups, recipe, reduce_amax)
    data = coll.raw_all_gather(q.data.view(torch.uint8), pg).view(q.data.dtype)
    scale = coll.raw_all_gather(q.scale_inv, pg)
    return Quantized(data.view(num_groups, out_features, k), scale.view(num_groups, out_features))


class Fp8GroupedFn(torch.autograd.Function):
    """The FP8 grouped GEMM, emulated (reference of ``BasicGroupedLinear`` with a recipe): forward
    and dgrad on FP8 operands, wgrad too with ``recipe.fp8_wgrad`` (else in float32); FSDP weights
    gathered as FP8, gradients reduce-scattered."""

    @staticmethod
    def forward(ctx, x, group_sizes, weight, bias, op):
        wq = fp8_grouped_weight(weight, op.num_groups, op.out_features, op.recipe, op.fsdp_group if op.fsdp else None)
        xq = fp8_grouped.input_operand(x, group_sizes, op.recipe)
        ctx.save_for_backward(x, group_sizes, weight, bias)
        ctx.op = op
        return fp8_grouped.emulated_forward(xq, group_sizes, wq, op.full_bias_value(bias), x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, group_sizes, weight, bias = ctx.saved_tensors
        op = ctx.op
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        need_db = bias is not None and ctx.needs_input_grad[3]
        wt = None
        if need_dx and op.recipe.rowwise:  # W.T from the high-precision weight (gathered as it is)
            wt = fp8_grouped.weight_t_operand(None, op.recipe, op.full_weight_value(weight))
        elif need_dx:  # the FP8 weight's bytes transposed (gathered as FP8)
            wq = fp8_grouped_weight(weight, op.num_groups, op.out_features, op.recipe,
                                    op.fsdp_group if op.fsdp else None)
            wt = fp8_grouped.weight_t_operand(wq, op.recipe)
        shape = (op.num_groups, op.out_features, op.in_features)
        dx, dw, db = fp8_grouped.emulated_backward(dy.contiguous(), x, group_sizes, wt, need_dx, need_dw, need_db,
                                                   shape, op.recipe.fp8_wgrad)
        if op.fsdp:
            if need_dw:
                dw = coll.raw_reduce_scatter(dw.reshape(-1, op.in_features), op.fsdp_group)
            if need_db:
                db = coll.raw_reduce_scatter(db.reshape(-1), op.fsdp_group)
        return (dx if need_dx else None, None, dw.to(weight.dtype) if need_dw else None,
                db if need_db else None, None)
