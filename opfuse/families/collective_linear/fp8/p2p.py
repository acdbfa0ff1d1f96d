"""The ``p2p_overlap`` implementation of ``all_gather_linear_fp8``: the forward all-gather moves FP8
bytes over peer memory (half the bytes of bfloat16) while ``torch._scaled_mm`` GEMMs each arriving
shard, on the gather plan of :mod:`..overlap.schedules` (:func:`..p2p._bound` with ``scaled=True``).

One scale per tensor only (shared by the group's ranks: every shard's GEMM takes the same
``scale_a``); per-row scales go to the ``nccl`` implementation. Backward is the ``nccl`` one (dgrad,
then a reduce-scatter in the activation dtype overlapped with the wgrad GEMM on the re-gathered
FP8 ``x``).
"""

from __future__ import annotations

from ....fp8.recipe import E4M3, recipe_from_key
from ....ops import group as groups
from ...linear.fp8 import scaled_mm
from ...linear.fp8.reference import payload_out
from ...quantize import kernels
from ....runtime import symm_pool
from ....runtime.device import is_capturing
from . import common as fp8_common, nccl as fp8_nccl
from .. import p2p
from ..overlap import planner as plans, policy, resources

__all__ = ["check", "prepare", "forward", "backward"]


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

