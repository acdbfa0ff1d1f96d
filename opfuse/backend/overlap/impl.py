"""The ``p2p_overlap`` implementation of ``all_gather_linear`` and ``linear_reduce_scatter``:
forward, backward and capability checks, with the signatures fixed by
:mod:`opfuse.backend.fused.linear_comm`.

=========================  ======================================================================
op / direction             pipeline
=========================  ======================================================================
AllGatherLinear fwd        gather-push + GEMM per arriving shard (own shard first)
AllGatherLinear bwd        dgrad reduce-scatter (ring or direct, below) of dy @ W while comm2
                           re-gathers x; then one wgrad GEMM on the gathered x; db = sum(dy)
LinearReduceScatter fwd    large chunks: ring, GEMM per (chunk, sub-chunk), partial sums
                           accumulated by the next rank's GEMM epilogue; small chunks: direct,
                           whole-chunk partials pushed to their owner and summed once
LinearReduceScatter bwd    gather-push of dy + dgrad GEMM per arriving shard, gathered dy kept
                           in the region for one wgrad GEMM; db = sum(dy or gathered dy)
=========================  ======================================================================

Precision: GEMMs accumulate in fp32 (cuBLAS). A ring hop adds the incoming bf16/fp16 partial in
the fp32 epilogue and rounds once, so a reduced element is rounded ``world - 1`` times, as in
NCCL's ring (the reference); the direct schedule sums the ``world`` rounded partials in fp32 and
rounds once.

A bias is added once per output element, in the cuBLASLt epilogue of a chain's first GEMM (ring:
the chunk owner's bias, read from its symmetric slot) or of the owner's own GEMM (direct). For
``bias_after=False`` (every rank adds its own bias before the sum) that bias is the sum of the
ranks' bias vectors, all-reduced first ([N] elements: one small NCCL call, the only exposed
communication of that variant). The ranks' biases need not be equal in either placement.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...ops import group as groups
from ...ops.base import OpInputError
from ...ops.norm import compute_dtype
from . import policy, resources
from . import plan as plans
from . import schedules

__all__ = ["NAME", "check_all_gather_linear", "check_linear_reduce_scatter", "all_gather_linear_forward",
           "all_gather_linear_backward", "linear_reduce_scatter_forward", "linear_reduce_scatter_backward"]

NAME = "p2p_overlap"
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


# Capability checks ------------------------------------------------------------------------------


def _basic_reason(spec) -> Optional[str]:
    x, w, b = spec.x, spec.inputs["weight"], spec.inputs.get("bias")
    if torch.device(x.device).type != "cuda":
        return f"needs CUDA tensors (x is on {x.device})"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} not supported (bfloat16, float16; float32 runs the reference)"
    if w.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
        return f"mixed dtypes (x {x.dtype}, weight {w.dtype}{', bias ' + str(b.dtype) if b is not None else ''})"
    if spec.world_size < 2:
        return "group has one rank: nothing to overlap"
    if spec.group_name is None:
        return "no process group"
    if resources.is_capturing():
        return "cannot reserve symmetric memory during CUDA-graph capture"
    return None


def _pool_reason(spec, needs: list, channels: list) -> Optional[str]:
    """Reserve ``needs`` (``(kind, rows, cols)``) in the group's pool and check ``channels``
    (:class:`~.policy.ChannelMap`) fit the signal pad. Collective in effect (see module doc)."""
    ctx = resources.context(spec.group_name, spec.device)
    if ctx is None:
        from ..symm_pool import unavailable_reason

        reason = unavailable_reason(groups.from_name(spec.group_name), spec.device)
        return f"no peer memory: {reason or 'symmetric pool unavailable'}"
    available = policy.ChannelMap.available(resources.signal_pad_bytes(), spec.world_size)
    for cmap in channels:
        if cmap.end > available:
            return (f"needs signal channels up to {cmap.end - 1}, the signal pad has {available} at world "
                    f"{spec.world_size} (lower OPFUSE_OVERLAP_CHUNKS)")
    itemsize = torch.empty((), dtype=spec.x.dtype).element_size()
    for kind, rows, cols in needs:
        if resources.RESERVE[kind](ctx.pool, spec.world_size, rows, cols, itemsize) is None:
            size = resources.BYTES[kind](spec.world_size, rows, cols, itemsize)
            return (f"symmetric pool has no room for a {kind} region of {size / 2**20:.1f} MiB "
                    f"(raise OPFUSE_SYMM_POOL_MAX_MB)")
    return None


def check_all_gather_linear(spec) -> Optional[str]:
    """Capable when CUDA, bf16/fp16, world >= 2, the group has peer memory and the regions fit.
    Reserves the forward region (and the backward ones when the program needs gradients)."""
    reason = _basic_reason(spec)
    if reason:
        return reason
    x = spec.x
    rows, k = x.tokens, x.features
    setting, world = resources.chunk_setting(), spec.world_size
    gather = policy.gather_grid(rows, k, setting)
    needs, channels = [("gather", rows, k)], [policy.channel_map(world, gather, None)]
    if spec.requires_grad:
        needs += _rs_regions(world, rows, k, None, setting)
        channels.append(_rs_channels(world, rows, k, setting, gather))
    return _pool_reason(spec, needs, channels)


def check_linear_reduce_scatter(spec) -> Optional[str]:
    """As :func:`check_all_gather_linear`. Tokens (dim 0) not divisible by the world size is an
    error here, at compile time, rather than a fallback: no implementation can scatter them."""
    x, w = spec.x, spec.inputs["weight"]
    world = spec.world_size
    if x.shape and x.shape[0] % world:
        raise OpInputError(
            f"LinearReduceScatter: dim 0 of x {list(x.shape)} is {x.shape[0]}, not divisible by the world size "
            f"{world}; pass a token count that is a multiple of {world}")
    reason = _basic_reason(spec)
    if reason:
        return reason
    rows, n = x.tokens // world, w.shape[0]
    setting = resources.chunk_setting()
    bias = None if spec.inputs.get("bias") is None else ("owner" if spec.attrs.get("bias_after", True) else "local")
    needs = _rs_regions(world, rows, n, bias, setting)
    channels = [_rs_channels(world, rows, n, setting)]
    if spec.requires_grad:
        needs.append(("gather", rows, n))
        channels.append(policy.channel_map(world, policy.gather_grid(rows, n, setting), None))
    return _pool_reason(spec, needs, channels)


# Bound plans ----------------------------------------------------------------------------------


def _bound(ctx, key: tuple, build, regions: dict, dtype: torch.dtype, region_cols: dict):
    """The cached BoundPlan for ``key`` or a new one; ``None`` when a region is missing or the
    channels do not fit (the caller runs the reference, as every rank does)."""
    bound = ctx.plans.get(key)
    if bound is not None:
        return bound
    if any(region is None for region in regions.values()):
        return None
    plan = build()
    plans.validate(plan)
    if plan.channels is not None and plan.channels.end > policy.ChannelMap.available(
            resources.signal_pad_bytes(), ctx.world):
        return None
    from .executor import BoundPlan

    bound = BoundPlan(plan, regions, dtype, region_cols)
    ctx.plans[key] = bound
    return bound


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _gather_plan(ctx, rows: int, k: int, n: int, dtype, *, bias: bool, fill_own: bool, gemm: bool):
    setting = resources.chunk_setting()
    forced = policy.ALTERNATE_GEMM_STREAMS
    key = ("gather", rows, k, n, dtype, bias, fill_own, gemm, setting, forced)
    bound = ctx.plans.get(key)
    if bound is not None:
        return bound
    grid = policy.gather_grid(rows, k, setting)
    channels = policy.channel_map(ctx.world, grid, None)
    region = resources.gather_region(ctx.pool, ctx.world, rows, k, _itemsize(dtype))
    # Shard GEMMs are rows x n: group small ones, second stream where their tail is worth it.
    alternate = gemm and policy.alternate_gemms(rows, n, ctx.sms)
    group = policy.gather_group(rows, n, setting, ctx.sms) if gemm else 1
    return _bound(ctx, key, lambda: schedules.all_gather_matmul_plan(ctx.rank, ctx.world, grid, n, channels,
                                                                      bias=bias, fill_own=fill_own, gemm=gemm,
                                                                      alternate=alternate, group=group),
                  {"gather": region}, dtype, {"gather": k})


def _rs_regions(world: int, rows: int, n: int, bias: Optional[str], setting: int) -> list:
    """``(kind, rows, cols)`` of the regions a reduce-scatter of ``rows x n`` chunks needs."""
    algorithm, _ = policy.rs_algorithm(rows, n, setting)
    if algorithm == "direct":
        return [("direct", rows, n)]
    return [("ring", rows, n)] + ([("bias", 1, n)] if bias == "owner" else [])


def _rs_channels(world: int, rows: int, n: int, setting: int, side: Optional[policy.Grid] = None):
    algorithm, grid = policy.rs_algorithm(rows, n, setting)
    return policy.channel_map(world, side, grid, direct=algorithm == "direct")


def _rs_plan(ctx, rows: int, n: int, dtype, *, bias: Optional[str], side_k: Optional[int] = None):
    """Reduce-scatter of ``rows x n`` chunks, ring or direct (:func:`.policy.rs_algorithm`);
    ``bias``: a :data:`~.schedules.BIAS_MODES` value; ``side_k``: also re-gather a ``[rows, side_k]``
    shard."""
    setting = resources.chunk_setting()
    forced = policy.ALTERNATE_GEMM_STREAMS
    key = ("rs", rows, n, dtype, bias, side_k, setting, forced)
    bound = ctx.plans.get(key)
    if bound is not None:
        return bound
    algorithm, grid = policy.rs_algorithm(rows, n, setting)
    side = policy.gather_grid(rows, side_k, setting) if side_k is not None else None
    channels = policy.channel_map(ctx.world, side, grid, direct=algorithm == "direct")
    itemsize = _itemsize(dtype)
    regions, cols = {}, {}
    for kind, r, c in _rs_regions(ctx.world, rows, n, bias, setting):
        regions[kind] = resources.RESERVE[kind](ctx.pool, ctx.world, r, c, itemsize)
        cols[kind] = grid.sub_cols if kind == "ring" else c
    if side is not None:
        regions["gather"] = resources.gather_region(ctx.pool, ctx.world, rows, side_k, itemsize)
        cols["gather"] = side_k
    if algorithm == "direct":
        alternate = policy.alternate_gemms(rows, n, ctx.sms)

        def build():
            return schedules.matmul_reduce_scatter_direct_plan(ctx.rank, ctx.world, rows, n, channels,
                                                                bias=bias is not None, side_gather=side,
                                                                alternate=alternate)
    else:
        def build():
            # No alternation in the ring: two half-chunk GEMMs of one step running concurrently
            # would both finish late and eat the hop's slack; its sub-GEMMs are >= 2 waves anyway.
            return schedules.matmul_reduce_scatter_plan(ctx.rank, ctx.world, grid, channels, bias=bias,
                                                         side_gather=side, alternate=False)
    return _bound(ctx, key, build, regions, dtype, cols)


def _context(group: str, t: Tensor):
    if t.device.type != "cuda" or t.dtype not in SUPPORTED_DTYPES:
        return None
    ctx = resources._CONTEXTS.get((group, t.device.index))
    if ctx is not None or resources.is_capturing():
        # In capture: lookups only (a context is created, collectively, at compile time).
        return ctx
    return resources.context(group, t.device)


def _sum_over_ranks(t: Tensor, ctx) -> Tensor:
    """``sum_r t_r`` on every rank (a bias vector: small, so one NCCL all-reduce)."""
    from ...ops.collectives import raw_all_reduce

    return raw_all_reduce(t, ctx.group)


def _sum_rows(t: Tensor) -> Tensor:
    return t.sum(0, dtype=compute_dtype(t.dtype)).to(t.dtype)


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


# AllGatherLinear ----------------------------------------------------------------------------------


def all_gather_linear_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], *, group: str) -> Tensor:
    """``all_gather_tokens(x) @ weight.T + bias``, each peer's shard GEMM'd as it lands."""
    ctx = _context(group, x)
    k, n = x.shape[-1], weight.shape[0]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    bound = ctx and _gather_plan(ctx, x2.shape[0], k, n, x.dtype, bias=bias is not None, fill_own=False, gemm=True)
    if not bound:
        from ..fused.linear_comm import ag_linear_reference

        return ag_linear_reference(x, weight, bias, group=group)
    x2 = x2.contiguous()
    out = x.new_empty((ctx.world * x2.shape[0], n))
    bound(weight.t(), a=x2, out=out, biasin=None if bias is None else bias.reshape(1, n))
    return out if x.dim() == 2 else out.view((x.shape[0] * ctx.world,) + tuple(x.shape[1:-1]) + (n,))


def all_gather_linear_backward(dy: Tensor, x: Tensor, weight: Tensor, *, group: str, need_dx: bool, need_dw: bool,
                               need_db: bool):
    """``dx = reduce_scatter(dy @ weight)`` as a ring while ``x`` is re-gathered on a second
    side stream; ``dw = dy.T @ gathered x``; ``db = sum(dy)``."""
    ctx = _context(group, dy)
    n, k = weight.shape
    dy2, x2 = dy.reshape(-1, n), x.reshape(-1, k)
    rows = x2.shape[0]
    bound = None
    if ctx and (need_dx or need_dw):
        if need_dx:
            bound = _rs_plan(ctx, rows, k, dy.dtype, bias=None, side_k=k if need_dw else None)
        else:
            bound = _gather_plan(ctx, rows, k, 0, dy.dtype, bias=False, fill_own=True, gemm=False)
    if ctx is None or ((need_dx or need_dw) and not bound):
        from ..fused.linear_comm import ag_linear_backward_reference

        return ag_linear_backward_reference(dy, x, weight, group=group, need_dx=need_dx, need_dw=need_dw,
                                            need_db=need_db)
    dy2, x2 = dy2.contiguous(), x2.contiguous()
    dx = dw = db = _empty(dy)
    if need_dx:
        dx2 = dy.new_empty((rows, k))
        bound(weight, a=dy2, out=dx2, x=x2)
        dx = dx2.view(x.shape)
    elif need_dw:
        bound(weight, a=x2)
    if need_dw:
        # The gathered x stays valid until this rank's next overlap call (peers write the region
        # only after that call's barrier), and this GEMM is ordered before it on this stream.
        dw = dy2.t().mm(bound.local("gather"))
    if need_db:
        db = _sum_rows(dy2)
    return dx, dw, db


# LinearReduceScatter ---------------------------------------------------------------------------------


def linear_reduce_scatter_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], *, bias_after: bool,
                                  group: str) -> Tensor:
    """``reduce_scatter_tokens(x @ weight.T) + bias`` (``bias_after=False``: the sum of every
    rank's ``x_r @ weight_r.T + bias_r``) as a ring of GEMMs accumulating in their epilogues."""
    ctx = _context(group, x)
    kl, n = x.shape[-1], weight.shape[0]
    x2 = x if x.dim() == 2 else x.reshape(-1, kl)
    mode = None if bias is None else ("owner" if bias_after else "local")
    bound = None
    if ctx and x.shape[0] % ctx.world == 0:
        bound = _rs_plan(ctx, x2.shape[0] // ctx.world, n, x.dtype, bias=mode)
    if not bound:
        from ..fused.linear_comm import linear_rs_reference

        return linear_rs_reference(x, weight, bias, bias_after=bias_after, group=group)
    x2 = x2.contiguous()
    rows = x2.shape[0] // ctx.world
    out = x.new_empty((rows, n))
    biasin = None
    if mode == "owner":
        biasin = bias.reshape(1, n)
    elif mode == "local":
        biasin = _sum_over_ranks(bias, ctx).reshape(1, n)
    bound(weight.t(), a=x2, out=out, biasin=biasin)
    return out if x.dim() == 2 else out.view((x.shape[0] // ctx.world,) + tuple(x.shape[1:-1]) + (n,))


def linear_reduce_scatter_backward(dy: Tensor, x: Tensor, weight: Tensor, *, bias_after: bool, group: str,
                                   need_dx: bool, need_dw: bool, need_db: bool):
    """``dy`` gathered by push while ``dx = gathered dy @ weight`` runs per arriving shard; the
    gathered ``dy`` (kept in the region) feeds ``dw = gathered.T @ x`` and, for a per-rank bias,
    ``db``."""
    ctx = _context(group, dy)
    n, kl = weight.shape
    dy2, x2 = dy.reshape(-1, n), x.reshape(-1, kl)
    rows = dy2.shape[0]
    keep = need_dw or (need_db and not bias_after)
    bound = None
    if ctx and (need_dx or keep):
        bound = _gather_plan(ctx, rows, n, kl, dy.dtype, bias=False, fill_own=keep, gemm=need_dx)
    if ctx is None or ((need_dx or keep) and not bound):
        from ..fused.linear_comm import linear_rs_backward_reference

        return linear_rs_backward_reference(dy, x, weight, bias_after=bias_after, group=group, need_dx=need_dx,
                                            need_dw=need_dw, need_db=need_db)
    dy2, x2 = dy2.contiguous(), x2.contiguous()
    dx = dw = db = _empty(dy)
    dx2 = None
    if need_dx:
        dx2 = dy.new_empty((ctx.world * rows, kl))
        dx = dx2.view(x.shape)
    if bound:
        bound(weight, a=dy2, out=dx2)
    if need_dw:
        dw = bound.local("gather").t().mm(x2)
    if need_db:
        db = _sum_rows(dy2 if bias_after else bound.local("gather"))
    return dx, dw, db
