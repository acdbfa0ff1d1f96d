"""The one function that says what an overlap call runs: which schedule, grids, signal channels,
symmetric regions, and the plan itself. The capability check (does it fit?), the preparation
(reserve and bind) and the call (look up the bound plan) all go through :func:`layout`, so they
agree on every rank by construction.

A :class:`Request` names one call shape: the gather schedule (``all_gather_matmul_plan``: the
forward of all-gather + GEMM, the backward of GEMM + reduce-scatter) or the reduce-scatter
schedules (``matmul_reduce_scatter_plan`` ring / ``..._direct_plan``: the forward of GEMM +
reduce-scatter, the backward of all-gather + GEMM). Settings (``OPFUSE_OVERLAP_CHUNKS``,
``OPFUSE_OVERLAP_ALTERNATE_STREAMS``) are read when a layout is made and are part of its key.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from ....config import config
from . import policy, resources, schedules
from .plan import Plan, validate

__all__ = ["Request", "Layout", "gather_request", "reduce_scatter_request", "layout", "plan_for",
           "call_requests", "fingerprint_requests"]


@dataclasses.dataclass(frozen=True)
class Request:
    """One overlap call shape.

    ``schedule="gather"``: every rank's ``[rows, cols]`` shard is gathered; ``n`` GEMM output
    columns per gathered shard (``gemm=False``: gather only), ``bias`` (bool) in the GEMM epilogue,
    ``fill_own`` also copies the own shard into the gathered region (kept for a later GEMM).
    ``schedule="reduce_scatter"``: ``[rows, cols]`` chunks (one per rank) are GEMM'd and summed on
    their owner; ``bias`` is ``None`` / ``"owner"`` / ``"local"`` (:data:`.schedules.BIAS_MODES`);
    ``side_k`` also re-gathers a ``[rows, side_k]`` shard on a side stream.
    """

    schedule: str
    rows: int
    cols: int
    n: int = 0
    bias: object = None
    fill_own: bool = False
    gemm: bool = True
    side_k: Optional[int] = None
    itemsize: int = 2


def gather_request(rows: int, k: int, n: int, *, bias: bool = False, fill_own: bool = False, gemm: bool = True,
                   itemsize: int = 2) -> Request:
    return Request("gather", rows, k, n, bias, fill_own, gemm, None, itemsize)


def reduce_scatter_request(rows: int, n: int, *, bias: Optional[str] = None, side_k: Optional[int] = None,
                           itemsize: int = 2) -> Request:
    return Request("reduce_scatter", rows, n, 0, bias, False, True, side_k, itemsize)


@dataclasses.dataclass(frozen=True)
class Layout:
    """What :func:`layout` decided for one request at one world size."""

    request: Request
    world: int
    channels: policy.ChannelMap
    #: ``(kind, rows, cols)`` of the symmetric regions, and each region's 2-D view width.
    regions: tuple
    region_cols: dict
    build: Callable[[int], Plan]

    def region_names(self) -> list[tuple[str, str, int]]:
        """``(kind, name, bytes)`` of every region."""
        r = self.request
        return [(kind, resources.region_name(kind, rows, cols, r.itemsize),
                 resources.region_bytes(kind, self.world, rows, cols, r.itemsize)) for kind, rows, cols in self.regions]

    @property
    def key(self) -> tuple:
        return (self.request, config.overlap_chunks, config.overlap_alternate_streams)


def _rs_regions(rows: int, n: int, bias, algorithm: str) -> list:
    if algorithm == "direct":
        return [("direct", rows, n)]
    return [("ring", rows, n)] + ([("bias", 1, n)] if bias == "owner" else [])


def layout(request: Request, world: int, sms: int = policy.DEFAULT_SMS) -> Layout:
    """The schedule, channels, regions and plan builder of ``request`` at ``world`` ranks on a
    device with ``sms`` multiprocessors (the GEMM-size rules of :mod:`.policy`)."""
    setting = int(config.overlap_chunks)
    alternate_setting = config.overlap_alternate_streams
    r = request
    if r.schedule == "gather":
        grid = policy.gather_grid(r.rows, r.cols, setting)
        channels = policy.channel_map(world, grid, None)
        alternate = r.gemm and policy.alternate_gemms(r.rows, r.n, sms, alternate_setting)
        group = policy.gather_group(r.rows, r.n, setting, sms) if r.gemm else 1

        def build(rank: int) -> Plan:
            return schedules.all_gather_matmul_plan(rank, world, grid, r.n, channels, bias=bool(r.bias),
                                                    fill_own=r.fill_own, gemm=r.gemm, alternate=alternate,
                                                    group=group)

        return Layout(r, world, channels, (("gather", r.rows, r.cols),), {"gather": r.cols}, build)
    if r.schedule != "reduce_scatter":
        raise ValueError(f"overlap: schedule {r.schedule!r}; known: 'gather', 'reduce_scatter'")
    algorithm, grid = policy.rs_algorithm(r.rows, r.cols, setting)
    side = policy.gather_grid(r.rows, r.side_k, setting) if r.side_k is not None else None
    channels = policy.channel_map(world, side, grid, direct=algorithm == "direct")
    regions = _rs_regions(r.rows, r.cols, r.bias, algorithm)
    cols = {kind: (grid.sub_cols if kind == "ring" else c) for kind, _, c in regions}
    if side is not None:
        regions.append(("gather", r.rows, r.side_k))
        cols["gather"] = r.side_k
    if algorithm == "direct":
        alternate = policy.alternate_gemms(r.rows, r.cols, sms, alternate_setting)

        def build(rank: int) -> Plan:
            return schedules.matmul_reduce_scatter_direct_plan(rank, world, r.rows, r.cols, channels,
                                                                bias=r.bias is not None, side_gather=side,
                                                                alternate=alternate)
    else:
        def build(rank: int) -> Plan:
            # No alternation in the ring: two half-chunk GEMMs of one step running concurrently
            # would both finish late and eat the hop's slack; its sub-GEMMs are >= 2 waves anyway.
            return schedules.matmul_reduce_scatter_plan(rank, world, grid, channels, bias=r.bias,
                                                         side_gather=side, alternate=False)
    return Layout(r, world, channels, tuple(regions), cols, build)


def plan_for(request: Request, *, rank: int, world: int, sms: int = policy.DEFAULT_SMS, pool=None) -> Plan:
    """``rank``'s validated plan for ``request`` (reserving its regions in ``pool`` when given)."""
    lay = layout(request, world, sms)
    if pool is not None:
        for _kind, name, nbytes in lay.region_names():
            pool.reserve(name, nbytes)
    plan = lay.build(rank)
    validate(plan)
    return plan


def call_requests(op: str, rows: int, k: int, n: int, *, bias: bool, bias_after: bool, world: int,
                  requires_grad: bool, itemsize: int) -> list[Request]:
    """The requests a program's forward (and, when it needs gradients, backward) calls of ``op``
    make, with ``x`` of ``rows`` tokens (the local shard for ``all_gather_linear``, all tokens
    for ``linear_reduce_scatter``) x ``k`` features and ``n`` outputs: what the check sizes and
    ``prepare`` reserves and binds."""
    if op == "all_gather_tokens":  # the gather alone, every shard (the own one too) in the gathered region
        return [gather_request(rows, k, 0, fill_own=True, gemm=False, itemsize=itemsize)]
    if op == "all_gather_linear_keep":  # forward only; the own shard joins the gathered region it returns
        return [gather_request(rows, k, n, bias=bias, fill_own=True, itemsize=itemsize)]
    if op == "all_gather_linear":
        requests = [gather_request(rows, k, n, bias=bias, itemsize=itemsize)]
        if requires_grad:  # dx = reduce_scatter(dy @ w) while x is re-gathered for dw
            requests.append(reduce_scatter_request(rows, k, side_k=k, itemsize=itemsize))
        return requests
    if op == "linear_reduce_scatter":
        chunk = rows // world
        mode = None if not bias else ("owner" if bias_after else "local")
        requests = [reduce_scatter_request(chunk, n, bias=mode, itemsize=itemsize)]
        if requires_grad:  # dy gathered while dx GEMMs each arriving shard; kept for dw
            requests.append(gather_request(chunk, n, k, fill_own=True, itemsize=itemsize))
        return requests
    raise ValueError(f"overlap: op {op!r}; known: 'all_gather_linear', 'all_gather_linear_keep', "
                     f"'all_gather_tokens', 'linear_reduce_scatter'")


def fingerprint_requests(rows: int, k: int, n: int) -> list[tuple[str, Request]]:
    """Named requests covering every call the overlap implementation makes (for
    tools/overlap_plan_fingerprint.py)."""
    out = [(f"ag_fwd_bias{int(b)}", gather_request(rows, k, n, bias=b)) for b in (False, True)]
    out += [("ag_bwd_dx_dw", reduce_scatter_request(rows, k, side_k=k)),
            ("ag_bwd_dx", reduce_scatter_request(rows, k)),
            ("ag_bwd_dw", gather_request(rows, k, 0, fill_own=True, gemm=False))]
    out += [(f"rs_fwd_{mode}", reduce_scatter_request(rows, k, bias=mode)) for mode in (None, "owner", "local")]
    out += [("rs_bwd_dx_keep", gather_request(rows, k, n, fill_own=True)),
            ("rs_bwd_dx", gather_request(rows, k, n)),
            ("rs_bwd_keep", gather_request(rows, k, n, fill_own=True, gemm=False))]
    return out
