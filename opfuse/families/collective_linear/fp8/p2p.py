"""The ``p2p_overlap`` implementations of the FP8 collective GEMMs, on the plans of
:mod:`..overlap.schedules` bound with ``scaled=True`` (:func:`..p2p._bound`: ``torch._scaled_mm``
GEMMs). One scale per tensor only: every GEMM of a call takes the same ``scale_a``; per-row scales
go to the ``nccl`` implementations.

* ``all_gather_linear_fp8``: the forward all-gather moves FP8 bytes over peer memory (half the bytes
  of bfloat16) while each arriving shard is GEMM'd (the gather plan). The scale is shared by the
  group's ranks. Backward is the ``nccl`` one (dgrad, then a reduce-scatter in the activation dtype
  overlapped with the wgrad GEMM on the re-gathered FP8 ``x``).
* ``linear_reduce_scatter_fp8``: the bfloat16 op's reduce-scatter plans (ring: GEMM sub-chunks
  whose partial sums are pushed to the next rank, which adds its own; direct: whole-chunk partials
  pushed to their owner and summed once) with FP8 GEMMs: the partial sums travel in the activation
  dtype, as NCCL's reduce-scatter of the ``nccl`` implementation sums them. Each rank's own scale
  (nothing shared). A ring hop rounds the FP8 product to the output dtype, then adds it to the
  incoming partial in float32 and rounds again (``torch._scaled_mm`` has no beta). Backward: ``dy``
  (a scale shared by the group) pushed over peer memory while the dgrad GEMMs each arrived shard,
  the gathered ``dy`` kept for the FP8 wgrad, as the bfloat16 backward does.
"""

from __future__ import annotations

import torch

from ....fp8.numerics import Quantized
from ....fp8.recipe import E4M3, recipe_from_key
from ....ops import group as groups
from ....ops.collectives import raw_reduce_scatter
from ...linear.fp8 import scaled_mm
from ...linear.fp8.reference import payload_out
from ...quantize import kernels
from ....runtime.device import is_capturing
from . import common as fp8_common, nccl as fp8_nccl
from .. import p2p
from ..overlap import planner as plans, resources

__all__ = ["check", "prepare", "forward", "backward", "rs_check", "rs_prepare", "rs_forward", "rs_backward"]


def _request(spec) -> plans.Request:
    x, w = spec.x, spec.inputs["weight"]
    return plans.gather_request(x.tokens, x.features, w.shape[0], bias=spec.inputs.get("bias") is not None,
                                itemsize=1)


def _scaled_reason(spec) -> str | None:
    """What both FP8 overlaps need before their plans: the FP8 GEMM's conditions, one scale per
    tensor, a peer to overlap with, no capture in progress."""
    reason = scaled_mm.check(spec)
    if reason:
        return reason
    if spec.attrs["recipe"].rowwise or (spec.x.quantized or "").endswith("/row"):
        return "per-row scales: the nccl implementation takes them"
    if spec.world_size < 2:
        return "group has one rank: nothing to overlap"
    if is_capturing():
        return "cannot reserve symmetric memory during CUDA-graph capture"
    return None


def check(spec) -> str | None:
    return _scaled_reason(spec) or p2p._room_reason(spec, [_request(spec)])


def prepare(spec) -> None:
    ctx = resources.context(spec.group_name, spec.device)
    if p2p._bound(ctx, _request(spec), E4M3, scaled=True) is None:
        raise RuntimeError(f"{spec.op}: binding the FP8 gather plan failed after the check passed")


def forward(x, x_data, x_scale, weight, bias, group, recipe):
    r, pg = recipe_from_key(recipe), groups.from_name(group)
    k, n = x.shape[-1], weight.shape[0]
    xq = fp8_common.local_operand(x, x_data, x_scale, r, pg, kernels.quantize, kernels.amax)
    ctx = p2p._context(group, x)
    bound = ctx and p2p._bound(ctx, plans.gather_request(xq.data.shape[0], k, n, bias=bias is not None, itemsize=1),
                               E4M3, scaled=True)
    if not bound or xq.scale_inv.numel() != 1:
        y = fp8_nccl.ag_forward(x, xq.data.reshape(x.shape), xq.scale_inv, weight, bias, group, recipe)[0]
        return (y,) + payload_out(x, xq, x_data is not None)
    wq = scaled_mm.weight_operand(weight, r)
    out = x.new_empty((ctx.world * xq.data.shape[0], n))
    bound(wq.data.t(), a=xq.data.contiguous(), out=out, biasin=None if bias is None else bias.reshape(1, n),
          sa=xq.scale_inv.reshape(()), sb=wq.scale_inv.reshape(()), odt=x.dtype)
    y = out.view((x.shape[0] * ctx.world,) + tuple(x.shape[1:-1]) + (n,))
    return (y,) + payload_out(x, xq, x_data is not None)


backward = fp8_nccl.ag_backward


# linear_reduce_scatter_fp8 ---------------------------------------------------------------------------


def _rs_request(rows_per_rank: int, n: int, bias: bool, itemsize: int) -> plans.Request:
    return plans.reduce_scatter_request(rows_per_rank, n, bias="owner" if bias else None, itemsize=itemsize)


def _rs_grad_request(rows_per_rank: int, n: int, k: int, need_dx: bool, need_dw: bool) -> plans.Request:
    """The backward's plan: this rank's FP8 ``dy`` pushed to every peer while the dgrad GEMMs each
    arrived shard; the own shard kept in the region too when the wgrad reads the gathered ``dy``."""
    return plans.gather_request(rows_per_rank, n, k, fill_own=need_dw, gemm=need_dx, itemsize=1)


def _rs_requests(spec) -> list[tuple[plans.Request, torch.dtype]]:
    rows, (n, k) = spec.x.tokens // spec.world_size, spec.inputs["weight"].shape
    wanted = [(_rs_request(rows, n, spec.inputs.get("bias") is not None, spec.dtype.itemsize), spec.dtype)]
    recipe = spec.attrs["recipe"]
    if spec.requires_grad and recipe.fp8_wgrad:
        wanted.append((_rs_grad_request(rows, n, k, True, True), recipe.grad_dtype))
    return wanted


def rs_check(spec) -> str | None:
    """The FP8 GEMM's conditions, one scale per tensor, world >= 2, tokens divisible by the world
    size, peer memory with room for the regions and signal channels of the forward (and backward)."""
    reason = _scaled_reason(spec)
    if reason:
        return reason
    if spec.x.tokens % spec.world_size:
        return f"{spec.x.tokens} tokens do not split over {spec.world_size} ranks"
    return p2p._room_reason(spec, [request for request, _dtype in _rs_requests(spec)])


def rs_prepare(spec) -> None:
    """Bind the forward's (and, for training, the backward's) plans, every rank in program order."""
    ctx = resources.context(spec.group_name, spec.device)
    for request, dtype in _rs_requests(spec):
        if p2p._bound(ctx, request, dtype, scaled=True) is None:
            raise RuntimeError(f"{spec.op}: binding {request} failed after the check passed")


def rs_forward(x, x_data, x_scale, weight, bias, group, recipe):
    """``reduce_scatter_tokens(fp8(x) @ fp8(weight).T) + bias``, the GEMM chunks overlapped with
    the pushes of their partial sums."""
    r, pg = recipe_from_key(recipe), groups.from_name(group)
    n = weight.shape[0]
    xq, xt = scaled_mm.quantize_input(x, x_data, x_scale, weight, r, recipe)
    wq = scaled_mm.weight_operand(weight, r)
    ctx = p2p._context(group, x)
    rows = xq.data.shape[0]
    bound = None
    if ctx and rows % ctx.world == 0 and xq.scale_inv.numel() == 1 and wq.scale_inv.numel() == 1:
        bound = p2p._bound(ctx, _rs_request(rows // ctx.world, n, bias is not None, x.element_size()), x.dtype,
                           scaled=True)
    if bound:
        y = x.new_empty((rows // ctx.world, n))
        bound(wq.data.t(), a=xq.data.contiguous(), out=y, biasin=None if bias is None else bias.reshape(1, n),
              sa=xq.scale_inv.reshape(()), sb=wq.scale_inv.reshape(()), odt=x.dtype)
    else:  # no plan fits (the same on every rank): the GEMM, then NCCL's reduce-scatter
        y = raw_reduce_scatter(scaled_mm.scaled_mm(xq, wq, x.dtype), pg)
        if bias is not None:
            y = y + bias
    out = y.reshape((x.shape[0] // groups.world_size(pg),) + tuple(x.shape[1:-1]) + (n,))
    return (out,) + payload_out(x, xq, x_data is not None, xt)


def rs_backward(dy, x_data, x_scale, x_data_t, weight, group, recipe, need_dx, need_dw, need_db):
    """``dy`` quantized with a scale shared by the group and pushed to every peer over peer memory
    while ``dx = gathered dy @ weight`` runs per arriving shard; the gathered FP8 ``dy``, kept in the
    region, is transposed for the FP8 wgrad GEMM. Per-row scales and a high-precision wgrad take the
    ``nccl`` backward (the same choice on every rank: it depends on the recipe and the plan only)."""
    r = recipe_from_key(recipe)
    n, k = weight.shape
    dy2 = dy.reshape(-1, n)
    ctx = p2p._context(group, dy)
    bound = None
    if ctx is not None and not r.rowwise and r.fp8_wgrad and (need_dx or need_dw):
        bound = p2p._bound(ctx, _rs_grad_request(dy2.shape[0], n, k, need_dx, need_dw), r.grad_dtype, scaled=True)
    if not bound:
        return fp8_nccl.rs_backward(dy, x_data, x_scale, x_data_t, weight, group, recipe, need_dx, need_dw, need_db)
    pg = groups.from_name(group)
    local = fp8_common.shared_quantize(dy2.contiguous(), r.grad_dtype, False, pg, kernels.quantize, kernels.amax)
    dx = dw = dy.new_empty(0)
    wt = scaled_mm.weight_t_operand(weight, r) if need_dx else None
    dx2 = dy.new_empty((ctx.world * dy2.shape[0], k)) if need_dx else None
    bound(weight if wt is None else wt.data.t(), a=local.data, out=dx2, sa=local.scale_inv.reshape(()),
          sb=None if wt is None else wt.scale_inv.reshape(()), odt=dy.dtype)
    if need_dx:
        dx = dx2.view(x_data.shape)
    if need_dw:
        # The gathered dy stays valid until this rank's next overlap call (peers write the region
        # only after that call's barrier), and these kernels are ordered before it on this stream.
        dyt = scaled_mm.grad_t_operand(Quantized(bound.local("gather"), local.scale_inv), r)
        xq = Quantized(x_data.reshape(-1, k), x_scale)
        _, dw = scaled_mm.backward_gemms(dy2, None, dyt, xq, weight, r, False, True, x_data_t)
    db = dy2.sum(0, dtype=torch.float32).to(dy.dtype) if need_db else dy.new_empty(0)
    return dx, dw, db
