"""Reference (and CPU) implementations of the FP8 collective GEMMs: the float32 emulation of
:mod:`opfuse.fp8.linear` around ``torch.distributed`` collectives (gloo or NCCL).

* ``all_gather_linear_fp8``: ``x`` quantized (one scale shared by the group, or per row), the FP8
  bytes and scales all-gathered, the GEMM; backward: dgrad then a reduce-scatter (in the activation
  dtype), wgrad on the re-gathered FP8 ``x``.
* ``linear_reduce_scatter_fp8``: the GEMM of the local FP8 operands, then a reduce-scatter in the
  activation dtype, bias after it; backward: ``dy`` gathered, then dgrad and wgrad.
"""

from __future__ import annotations

from ....fp8 import linear as fp8_linear
from ....fp8 import numerics
from ....fp8.numerics import Quantized
from ....fp8.recipe import recipe_from_key
from ....ops import group as groups
from ....ops.collectives import raw_all_gather, raw_reduce_scatter
from ...linear.fp8.reference import payload_out
from . import common as fp8_common

__all__ = ["ag_forward", "ag_backward", "rs_forward", "rs_backward"]


def _amax(rows):
    return numerics.amax(rows, False)


def ag_forward(x, x_data, x_scale, weight, bias, group, recipe):
    r, pg = recipe_from_key(recipe), groups.from_name(group)
    xq = fp8_common.local_operand(x, x_data, x_scale, r, pg, numerics.quantize, _amax)
    y = fp8_linear.emulated_forward(fp8_common.gather(xq, pg), weight, bias, r, x.dtype)
    world = groups.world_size(pg)
    out = y.reshape((x.shape[0] * world,) + tuple(x.shape[1:-1]) + (weight.shape[0],))
    return (out,) + payload_out(x, xq, x_data is not None)


def ag_backward(dy, x_data, x_scale, x_data_t, weight, group, recipe, need_dx, need_dw, need_db):
    r, pg = recipe_from_key(recipe), groups.from_name(group)
    k = weight.shape[1]
    full = fp8_common.gather(Quantized(x_data.reshape(-1, k), x_scale), pg)
    dx, dw, db = fp8_linear.emulated_backward(dy.reshape(-1, weight.shape[0]), full, weight, r, need_dx, need_dw,
                                              need_db)
    if need_dx:
        dx = raw_reduce_scatter(dx, pg).reshape(x_data.shape)
    return dx, dw, db


def rs_forward(x, x_data, x_scale, weight, bias, group, recipe):
    r, pg = recipe_from_key(recipe), groups.from_name(group)
    xq = Quantized(x_data.reshape(-1, x.shape[-1]), x_scale) if x_data is not None else \
        fp8_linear.input_operand(x, r)
    partial = fp8_linear.emulated_forward(xq, weight, None, r, x.dtype)
    y = raw_reduce_scatter(partial, pg)
    if bias is not None:
        y = y + bias
    out = y.reshape((x.shape[0] // groups.world_size(pg),) + tuple(x.shape[1:-1]) + (weight.shape[0],))
    return (out,) + payload_out(x, xq, x_data is not None)


def rs_backward(dy, x_data, x_scale, x_data_t, weight, group, recipe, need_dx, need_dw, need_db):
    r, pg = recipe_from_key(recipe), groups.from_name(group)
    n, k = weight.shape
    dy2 = dy.reshape(-1, n)
    dy_full = raw_all_gather(dy2, pg)
    dx, dw, _ = fp8_linear.emulated_backward(dy_full, Quantized(x_data.reshape(-1, k), x_scale), weight, r, need_dx,
                                             need_dw, False)
    db = dy2.sum(0, dtype=fp8_linear.compute_dtype(dy.dtype)).to(dy.dtype) if need_db else dy.new_empty(0)
    return (dx.reshape(x_data.shape) if need_dx else dx), dw, db
