"""The ``nccl`` implementations of the FP8 collective GEMMs: ``torch._scaled_mm`` GEMMs
(:mod:`...linear.fp8.scaled_mm`) around ``torch.distributed`` collectives that move FP8 bytes.

* ``all_gather_linear_fp8``: forward gathers the FP8 ``x`` (half the bytes of bfloat16) and runs one
  GEMM. Backward starts re-gathering ``x`` before the dgrad GEMM and reduce-scatters ``dx`` (in the
  activation dtype) while the wgrad GEMM runs.
* ``linear_reduce_scatter_fp8``: forward is the GEMM, then the reduce-scatter of the partial sums (in
  the activation dtype: a sum of FP8-rounded partials would lose the precision the FP8 GEMM kept).
  Backward quantizes ``dy`` (scale shared by the group, or per row) and gathers it in FP8.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ....fp8.numerics import Quantized
from ....fp8.recipe import recipe_from_key
from ....ops import group as groups
from ....ops.collectives import raw_all_gather, raw_reduce_scatter, start_reduce_scatter
from ...linear.fp8 import scaled_mm
from ...linear.fp8.reference import payload_out
from ...quantize import kernels
from . import common as fp8_common

__all__ = ["check", "ag_forward", "ag_backward", "rs_forward", "rs_backward"]


def check(spec) -> str | None:
    """The FP8 GEMM's conditions (:func:`...linear.fp8.scaled_mm.check`) and an NCCL group."""
    reason = scaled_mm.check(spec)
    if reason:
        return reason
    if dist.get_backend(groups.from_name(spec.group_name)) != "nccl":
        return "group backend is not NCCL"
    return None


def _amax(rows):
    return kernels.amax(rows)


def ag_forward(x, x_data, x_scale, weight, bias, group, recipe):
    r, pg = recipe_from_key(recipe), groups.from_name(group)
    xq = fp8_common.local_operand(x, x_data, x_scale, r, pg, kernels.quantize, _amax)
    y = scaled_mm.scaled_mm(fp8_common.gather(xq, pg), scaled_mm.weight_operand(weight, r), x.dtype, bias)
    out = y.reshape((x.shape[0] * groups.world_size(pg),) + tuple(x.shape[1:-1]) + (weight.shape[0],))
    return (out,) + payload_out(x, xq, x_data is not None)


def ag_backward(dy, x_data, x_scale, x_data_t, weight, group, recipe, need_dx, need_dw, need_db):
    r, pg = recipe_from_key(recipe), groups.from_name(group)
    n, k = weight.shape
    dy2 = dy.reshape(-1, n)
    finish = fp8_common.start_gather(Quantized(x_data.reshape(-1, k), x_scale), pg) if need_dw else None
    dyq, dyt = scaled_mm.grad_operands(dy2, r, need_dx, need_dw)
    dx = dw = dy.new_empty(0)
    pending = None
    if need_dx:
        dx_full, _ = scaled_mm.backward_gemms(dy2, dyq, None, None, weight, r, True, False)
        pending = start_reduce_scatter(dx_full, pg)
    if need_dw:
        _, dw = scaled_mm.backward_gemms(dy2, None, dyt, finish(), weight, r, False, True)
    db = dy2.sum(0, dtype=torch.float32).to(dy.dtype) if need_db else dy.new_empty(0)
    if pending is not None:
        out, work = pending
        work.wait()
        dx = out.reshape(x_data.shape)
    return dx, dw, db


def rs_forward(x, x_data, x_scale, weight, bias, group, recipe):
    r, pg = recipe_from_key(recipe), groups.from_name(group)
    xq, xt = scaled_mm.quantize_input(x, x_data, x_scale, weight, r, recipe)
    y = raw_reduce_scatter(scaled_mm.scaled_mm(xq, scaled_mm.weight_operand(weight, r), x.dtype), pg)
    if bias is not None:
        y = y + bias
    out = y.reshape((x.shape[0] // groups.world_size(pg),) + tuple(x.shape[1:-1]) + (weight.shape[0],))
    return (out,) + payload_out(x, xq, x_data is not None, xt)


def rs_backward(dy, x_data, x_scale, x_data_t, weight, group, recipe, need_dx, need_dw, need_db):
    r, pg = recipe_from_key(recipe), groups.from_name(group)
    n, k = weight.shape
    dy2 = dy.reshape(-1, n)
    xq = Quantized(x_data.reshape(-1, k), x_scale)
    dyq = dyt = dy_full = None
    if need_dw and not r.fp8_wgrad:  # the wgrad reads the high-precision dy: gather it as it is
        dy_full = raw_all_gather(dy2, pg)
        dyq, _ = scaled_mm.grad_operands(dy_full, r, need_dx, False)
    elif need_dx or need_dw:
        local = fp8_common.shared_quantize(dy2, r.grad_dtype, r.rowwise, pg, kernels.quantize, _amax)
        dyq = fp8_common.gather(local, pg)
        dyt = scaled_mm.grad_t_operand(dyq, r) if need_dw else None
    dx, dw = scaled_mm.backward_gemms(dy2 if dy_full is None else dy_full, dyq, dyt, xq, weight, r, need_dx, need_dw,
                                      x_data_t)
    db = dy2.sum(0, dtype=torch.float32).to(dy.dtype) if need_db else dy.new_empty(0)
    return (dx.reshape(x_data.shape) if need_dx else dx), dw, db
