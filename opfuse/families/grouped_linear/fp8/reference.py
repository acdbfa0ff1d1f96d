"""The reference (and CPU) implementation of ``grouped_linear_fp8``: the float32 emulation of
:mod:`opfuse.fp8.grouped` (a loop over host group sizes: it syncs on a GPU)."""

from __future__ import annotations

from ....fp8 import grouped as fp8_grouped
from ....fp8.recipe import recipe_from_key
from . import common

__all__ = ["forward", "backward"]


def forward(x, group_sizes, weight, bias, fsdp_group, num_groups, recipe):
    r = recipe_from_key(recipe)
    wq = common.weight_operand(weight, fsdp_group, num_groups, r)
    xq = fp8_grouped.input_operand(x, group_sizes, r)
    return fp8_grouped.emulated_forward(xq, group_sizes, wq, common.full_bias(bias, fsdp_group, num_groups), x.dtype)


def backward(dy, x, group_sizes, weight, bias, fsdp_group, num_groups, recipe, need_dx, need_dw, need_db):
    r = recipe_from_key(recipe)
    shape = common.shape_of(weight, fsdp_group, num_groups)
    wt = common.weight_t_operand(weight, fsdp_group, num_groups, r) if need_dx else None
    dx, dw, db = fp8_grouped.emulated_backward(dy, x, group_sizes, wt, need_dx, need_dw, need_db, shape, r.fp8_wgrad)
    dw, db = common.reduce_grads(dw, db, fsdp_group, need_dw, need_db, shape[2])
    return dx, dw.to(weight.dtype) if need_dw else dw, db
