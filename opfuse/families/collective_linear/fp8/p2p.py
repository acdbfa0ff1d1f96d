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
  incoming partial in float32 and rounds again (``torch._scaled_mm`` has no beta). Backward is the
  ``nccl`` one (dy gathered in FP8).
"""

from __future__ import annotations

from ....fp8.recipe import E4M3, recipe_from_key
from ....ops import group as groups
from ....ops.collectives import raw_reduce_scatter
from ...linear.fp8 import scaled_mm
from ...linear.fp8.reference import payload_out
from ...quantize import kernels
from ....runtime import symm_pool
from ....runtime.device import is_capturing
from . import common as fp8_common, nccl as fp8_nccl
from .. import p2p
from ..overlap import planner as plans, policy, resources

__all__ = ["check", "prepare", "forward", "backward", "rs_check", "rs_prepare", "rs_forward", "rs_backward"]


def _request(spec) -> plans.Request:
    x, w = spec.x, spec.inputs["weight"]
    return plans.gather_request(x.tokens, x.features, w.shape[0], bias=spec.inputs.get("bias") is not None,
                                itemsize=1)


def check(spec) -> str | None:
    reason = scaled_mm.check(spec)
    if reason:
        return reason
    if spec.attrs["recipe"].rowwise or (spec.x.quantized or "").endswith("/row"):
        return "per-row scales: the nccl implementation gathers them"
    if spec.world_size < 2:
        return "group has one rank: nothing to overlap"
    if is_capturing():
        return "cannot reserve symmetric memory during CUDA-graph capture"
    pool, why = symm_pool.lookup(spec.group_name, spec.device)
    if pool is None:
        return f"no peer memory: {why}"
    lay = plans.layout(_request(spec), spec.world_size)
    if lay.channels.end > policy.ChannelMap.available(resources.signal_pad_bytes(), spec.world_size):
        return f"needs signal channels up to {lay.channels.end - 1} (lower OPFUSE_OVERLAP_CHUNKS)"
    if not pool.can_reserve_all([(name, nbytes) for _kind, name, nbytes in lay.region_names()]):
        return "symmetric pool has no room for the FP8 gather region (raise OPFUSE_SYMM_POOL_MAX_MB)"
    return None


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


def rs_check(spec) -> str | None:
    """The FP8 GEMM's conditions, one scale per tensor, world >= 2, tokens divisible by the world
    size, peer memory with room for the forward's regions and signal channels."""
    reason = scaled_mm.check(spec)
    if reason:
        return reason
    if spec.attrs["recipe"].rowwise or (spec.x.quantized or "").endswith("/row"):
        return "per-row scales: the nccl implementation takes them"
    if spec.world_size < 2:
        return "group has one rank: nothing to overlap"
    if spec.x.tokens % spec.world_size:
        return f"{spec.x.tokens} tokens do not split over {spec.world_size} ranks"
    if is_capturing():
        return "cannot reserve symmetric memory during CUDA-graph capture"
    pool, why = symm_pool.lookup(spec.group_name, spec.device)
    if pool is None:
        return f"no peer memory: {why}"
    request = _rs_request(spec.x.tokens // spec.world_size, spec.inputs["weight"].shape[0],
                          spec.inputs.get("bias") is not None, spec.dtype.itemsize)
    lay = plans.layout(request, spec.world_size)
    if lay.channels.end > policy.ChannelMap.available(resources.signal_pad_bytes(), spec.world_size):
        return f"needs signal channels up to {lay.channels.end - 1} (lower OPFUSE_OVERLAP_CHUNKS)"
    if not pool.can_reserve_all([(name, nbytes) for _kind, name, nbytes in lay.region_names()]):
        return "symmetric pool has no room for the reduce-scatter regions (raise OPFUSE_SYMM_POOL_MAX_MB)"
    return None


def rs_prepare(spec) -> None:
    ctx = resources.context(spec.group_name, spec.device)
    request = _rs_request(spec.x.tokens // spec.world_size, spec.inputs["weight"].shape[0],
                          spec.inputs.get("bias") is not None, spec.dtype.itemsize)
    if p2p._bound(ctx, request, spec.dtype, scaled=True) is None:
        raise RuntimeError(f"{spec.op}: binding the FP8 reduce-scatter plan failed after the check passed")


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


rs_backward = fp8_nccl.rs_backward
