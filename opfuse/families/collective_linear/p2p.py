"""The ``p2p_overlap`` implementation of ``all_gather_linear`` and ``linear_reduce_scatter``:
capability checks, preparation, forward and backward, with the signatures of :mod:`.op`.

=========================  ======================================================================
op / direction             pipeline
=========================  ======================================================================
AllGatherTokens fwd        gather-push of every shard (the own one too) into the gathered region,
                           which is copied out; no GEMM, no SMs but the copy-out's
AllGatherLinear fwd        gather-push + GEMM per arriving shard (own shard first); the ``keep``
                           variant also copies the own shard into the region and returns it gathered
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

from ...config import config
from ...ops.base import OpInputError
from ...ops.norm import compute_dtype
from ...ops.collectives import raw_all_reduce
from ...runtime import symm_pool
from ...runtime.device import is_capturing
from .overlap import planner as plans, policy, resources
from . import reference
from .operands import HALF_DTYPES, operand_reason

__all__ = ["NAME", "check_all_gather_linear", "check_all_gather_linear_keep", "check_linear_reduce_scatter",
           "check_all_gather_tokens", "prepare", "all_gather_linear_forward", "all_gather_linear_keep_forward",
           "all_gather_linear_backward", "linear_reduce_scatter_forward", "linear_reduce_scatter_backward",
           "all_gather_tokens_forward", "MIN_GATHER_BYTES"]

NAME = "p2p_overlap"
SUPPORTED_DTYPES = HALF_DTYPES
#: A gather alone below this many bytes per rank stays NCCL's: its one kernel has less fixed cost
#: than the plan's barrier, per-peer copies and copy-out (2x H200: 1.42x NCCL's time at 1 MiB,
#: 1.02x at 16 MiB; docs/PERF_NOTES.md, "The backward all-gathers over peer memory").
MIN_GATHER_BYTES = 1 << 20


# Capability checks (pure) -----------------------------------------------------------------------


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _requests(spec) -> list:
    x, w = spec.x, spec.inputs.get("weight")
    return plans.call_requests(spec.op, x.tokens, x.features, 0 if w is None else w.shape[0],
                               bias=spec.inputs.get("bias") is not None,
                               bias_after=spec.attrs.get("bias_after", True), world=spec.world_size,
                               requires_grad=spec.requires_grad, itemsize=_itemsize(x.dtype))


def _basic_reason(spec) -> Optional[str]:
    reason = operand_reason(spec)
    if reason:
        return reason
    if is_capturing():
        return "cannot reserve symmetric memory during CUDA-graph capture"
    return None


def _check(spec) -> Optional[str]:
    return _basic_reason(spec) or _room_reason(spec, _requests(spec))


def _room_reason(spec, requests) -> Optional[str]:
    """Why the plans of ``requests`` cannot run in the group's peer memory (no pool, too few signal
    channels, no room for their regions), or ``None``."""
    pool, why = symm_pool.lookup(spec.group_name, spec.device)
    if pool is None:
        return f"no peer memory: {why}"
    available = policy.ChannelMap.available(resources.signal_pad_bytes(), spec.world_size)
    wanted = {}
    for request in requests:
        lay = plans.layout(request, spec.world_size)
        if lay.channels.end > available:
            return (f"needs signal channels up to {lay.channels.end - 1}, the signal pad has {available} at world "
                    f"{spec.world_size} (lower OPFUSE_OVERLAP_CHUNKS)")
        for _kind, name, nbytes in lay.region_names():
            wanted[name] = max(nbytes, wanted.get(name, 0))
    if not pool.can_reserve_all(list(wanted.items())):
        total = sum(wanted.values()) / 2**20
        return f"symmetric pool has no room for {total:.1f} MiB of overlap regions (raise OPFUSE_SYMM_POOL_MAX_MB)"
    return None


def check_all_gather_linear(spec) -> Optional[str]:
    """Capable when CUDA, bf16/fp16, world >= 2, the group has peer memory, and the regions and
    signal channels of the forward (and, for training, backward) calls fit."""
    return _check(spec)


def check_all_gather_linear_keep(spec) -> Optional[str]:
    """As :func:`check_all_gather_linear`, for the forward-only call that keeps the gathered input."""
    return _check(spec)


def check_all_gather_tokens(spec) -> Optional[str]:
    """Capable when turned on (``opfuse.config.p2p_gradient_gathers``), CUDA, bf16/fp16, world >= 2, at
    least :data:`MIN_GATHER_BYTES` per rank, and the gathered region and its signal channels fit in
    the group's peer memory."""
    x = spec.x
    if not config.p2p_gradient_gathers:
        return "off (OPFUSE_P2P_GRADIENT_GATHERS=1 turns it on)"
    if torch.device(x.device).type != "cuda":
        return f"needs CUDA tensors (x is on {x.device})"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} not supported (bfloat16, float16)"
    if spec.world_size < 2 or spec.group_name is None:
        return "needs a process group of two or more ranks"
    if len(x.shape) < 2:
        return f"x has shape {list(x.shape)}; needs a token dim before the features"
    if x.nbytes < MIN_GATHER_BYTES:
        return f"{x.nbytes} bytes per rank, below {MIN_GATHER_BYTES} (NCCL's gather costs less there)"
    if is_capturing():
        return "cannot reserve symmetric memory during CUDA-graph capture"
    return _room_reason(spec, _requests(spec))


def check_linear_reduce_scatter(spec) -> Optional[str]:
    """As :func:`check_all_gather_linear`. Tokens (dim 0) not divisible by the world size is an
    error here, at compile time, rather than a fallback: no implementation can scatter them."""
    x = spec.x
    if x.shape and x.shape[0] % spec.world_size:
        raise OpInputError(
            f"linear_reduce_scatter: dim 0 of x {list(x.shape)} is {x.shape[0]}, not divisible by the world size "
            f"{spec.world_size}; pass a token count that is a multiple of {spec.world_size}")
    return _check(spec)


def prepare(spec) -> None:
    """Reserve the regions of the program's calls and bind their plans (every rank, in program
    order, so every rank carves the same offsets)."""
    ctx = resources.context(spec.group_name, spec.device)
    for request in _requests(spec):
        if _bound(ctx, request, spec.dtype) is None:
            raise RuntimeError(f"{spec.op}: binding {request} failed after the check passed")


# Bound plans ----------------------------------------------------------------------------------


def _bound(ctx, request: plans.Request, dtype: torch.dtype, scaled: bool = False):
    """The bound plan of ``request`` (reserved and bound on first use, outside capture only);
    ``None`` when its regions or channels do not fit (identically on every rank: the caller
    runs the reference). ``scaled``: FP8 GEMMs (``torch._scaled_mm``) over ``dtype`` regions (FP8
    for a gathered operand, the output dtype for partial sums)."""
    lay = plans.layout(request, ctx.world, ctx.sms)
    key = (lay.key, dtype, scaled)
    bound = ctx.plans.get(key)
    if bound is not None or is_capturing():
        return bound
    if lay.channels.end > policy.ChannelMap.available(resources.signal_pad_bytes(), ctx.world):
        return None
    regions = {}
    for kind, name, nbytes in lay.region_names():
        regions[kind] = ctx.pool.reserve(name, nbytes)
        if regions[kind] is None:
            return None
    plan = lay.build(ctx.rank)
    plans.validate(plan)
    from .overlap.executor import BoundPlan  # touches torch.cuda: only where plans are bound

    bound = ctx.plans[key] = BoundPlan(plan, regions, dtype, lay.region_cols, scaled=scaled)
    return bound


def _context(group: str, t: Tensor):
    if t.device.type != "cuda" or t.dtype not in SUPPORTED_DTYPES:
        return None
    return resources.context(group, t.device)


def _sum_over_ranks(t: Tensor, ctx) -> Tensor:
    """``sum_r t_r`` on every rank (a bias vector: [N] elements, so one small NCCL call)."""
    return raw_all_reduce(t, ctx.group)


def _sum_rows(t: Tensor) -> Tensor:
    return t.sum(0, dtype=compute_dtype(t.dtype)).to(t.dtype)


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


# AllGatherLinear ----------------------------------------------------------------------------------


def _gather_gemm(x: Tensor, weight: Tensor, bias: Optional[Tensor], group: str, keep: bool):
    """Run the all-gather + GEMM pipeline: ``(out [world * rows, n], bound plan, world)``, or
    ``None`` when no plan fits (the caller runs the reference). ``keep``: the own shard is copied
    into the gathered region too, so the whole gathered input lies there after the call."""
    ctx = _context(group, x)
    k, n = x.shape[-1], weight.shape[0]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    bound = ctx and _bound(ctx, plans.gather_request(x2.shape[0], k, n, bias=bias is not None, fill_own=keep,
                                                     itemsize=x.element_size()), x.dtype)
    if not bound:
        return None
    x2 = x2.contiguous()
    out = x.new_empty((ctx.world * x2.shape[0], n))
    bound(weight.t(), a=x2, out=out, biasin=None if bias is None else bias.reshape(1, n))
    return out, bound, ctx.world


def _as_gathered(t: Tensor, x: Tensor, world: int) -> Tensor:
    """``t`` ([world * rows, cols]) with ``x``'s leading dims, the first one gathered."""
    return t if x.dim() == 2 else t.view((x.shape[0] * world,) + tuple(x.shape[1:-1]) + (t.shape[-1],))


def all_gather_linear_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], group: str) -> Tensor:
    """``all_gather_tokens(x) @ weight.T + bias``, each peer's shard GEMM'd as it lands."""
    ran = _gather_gemm(x, weight, bias, group, keep=False)
    if ran is None:
        return reference.ag_linear_forward(x, weight, bias, group)
    out, _, world = ran
    return _as_gathered(out, x, world)


def all_gather_linear_keep_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], group: str):
    """``(all_gather_tokens(x) @ weight.T + bias, all_gather_tokens(x))``: the forward's pipeline with
    the own shard in the gathered region too, which is then copied out (peers write the region again
    at this rank's next overlap call)."""
    ran = _gather_gemm(x, weight, bias, group, keep=True)
    if ran is None:
        return reference.ag_linear_keep_forward(x, weight, bias, group)
    out, bound, world = ran
    return _as_gathered(out, x, world), _as_gathered(bound.local("gather").clone(), x, world)


def all_gather_linear_backward(dy: Tensor, x: Tensor, weight: Tensor, group: str, need_dx: bool, need_dw: bool,
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
            request = plans.reduce_scatter_request(rows, k, side_k=k if need_dw else None, itemsize=dy.element_size())
        else:
            request = plans.gather_request(rows, k, 0, fill_own=True, gemm=False, itemsize=dy.element_size())
        bound = _bound(ctx, request, dy.dtype)
    if ctx is None or ((need_dx or need_dw) and not bound):
        return reference.ag_linear_backward(dy, x, weight, group, need_dx, need_dw, need_db)
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


def linear_reduce_scatter_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], bias_after: bool,
                                  group: str) -> Tensor:
    """``reduce_scatter_tokens(x @ weight.T) + bias`` (``bias_after=False``: the sum of every
    rank's ``x_r @ weight_r.T + bias_r``) as a ring of GEMMs accumulating in their epilogues."""
    ctx = _context(group, x)
    kl, n = x.shape[-1], weight.shape[0]
    x2 = x if x.dim() == 2 else x.reshape(-1, kl)
    mode = None if bias is None else ("owner" if bias_after else "local")
    bound = None
    if ctx and x.shape[0] % ctx.world == 0:
        bound = _bound(ctx, plans.reduce_scatter_request(x2.shape[0] // ctx.world, n, bias=mode,
                                                         itemsize=x.element_size()), x.dtype)
    if not bound:
        return reference.linear_rs_forward(x, weight, bias, bias_after, group)
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


def linear_reduce_scatter_backward(dy: Tensor, x: Tensor, weight: Tensor, bias_after: bool, group: str,
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
        bound = _bound(ctx, plans.gather_request(rows, n, kl, fill_own=keep, gemm=need_dx,
                                                 itemsize=dy.element_size()), dy.dtype)
    if ctx is None or ((need_dx or keep) and not bound):
        return reference.linear_rs_backward(dy, x, weight, bias_after, group, need_dx, need_dw, need_db)
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


# AllGatherTokens ---------------------------------------------------------------------------------


def all_gather_tokens_forward(x: Tensor, group: str) -> Tensor:
    """Every rank's ``x`` along dim 0, pushed by the copy engines into the gathered region, then
    copied out of it (peers write the region again at this rank's next overlap call)."""
    ctx = _context(group, x)
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else None
    bound = ctx and x2 is not None and _bound(ctx, plans.gather_request(x2.shape[0], x2.shape[1], 0, fill_own=True,
                                                                         gemm=False, itemsize=x.element_size()),
                                              x.dtype)
    if not bound:
        return reference.all_gather_tokens_forward(x, group)
    x2 = x2.contiguous()
    bound(x2, a=x2)
    gathered = bound.local("gather").clone()
    return gathered.view((x.shape[0] * ctx.world,) + tuple(x.shape[1:]))
