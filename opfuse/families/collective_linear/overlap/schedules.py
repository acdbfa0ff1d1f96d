"""The comm + GEMM schedules, as plan builders (one function per schedule; the instruction set
and the synchronisation rules they follow are in :mod:`.plan`):

* :func:`all_gather_matmul_plan`: push-based all-gather, a GEMM per arriving shard (or group of
  shards), or the gather alone;
* :func:`matmul_reduce_scatter_plan`: the ring, partial sums accumulated in GEMM epilogues;
* :func:`matmul_reduce_scatter_direct_plan`: whole-chunk partials pushed to their owner, summed
  while the owner's GEMMs run; only the last one is added after the own GEMM.
"""

from __future__ import annotations

from typing import Iterable, Optional

from .plan import (AUX, COMM, COMM2, COMPUTE, Barrier, Copy, Gemm, Plan, Probe, Put, Record, Sum, View, Wait,
                   WaitEvent)
from .policy import ChannelMap, Grid

__all__ = ["all_gather_matmul_plan", "matmul_reduce_scatter_plan",
           "matmul_reduce_scatter_direct_plan", "BIAS_MODES"]


class _Builder:
    def __init__(self, rank: int, world: int, alternate: bool = False):
        self.rank, self.world, self.alternate = rank, world, alternate
        self.out: list = []
        self.events = 0
        self.gemms = 0

    def gemm_stream(self) -> str:
        """The stream of the next chunk GEMM: compute, aux, compute, ... when alternating."""
        stream = AUX if self.alternate and self.gemms % 2 else COMPUTE
        self.gemms += 1
        return stream

    def emit(self, *instructions):
        self.out.extend(instructions)

    def event(self) -> int:
        self.events += 1
        return self.events - 1

    def fork(self, stream: str, barrier_channel: Optional[int]):
        """``stream`` (and aux) wait for the compute stream's work so far (then a barrier on
        ``stream``). Every side stream must be forked before it touches a per-call buffer: the
        caching allocator hands a per-call buffer out on the compute stream's order only."""
        ev = self.event()
        self.emit(Record(COMPUTE, ev), WaitEvent(stream, ev))
        if self.alternate:
            self.emit(WaitEvent(AUX, ev))
        if barrier_channel is not None:
            self.emit(Barrier(stream, barrier_channel))

    def join(self, streams: Iterable[str]):
        for stream in list(streams) + ([AUX] if self.alternate else []):
            ev = self.event()
            self.emit(Record(stream, ev), WaitEvent(COMPUTE, ev))


def _sub_view(buf: str, owner: int, base_row: int, grid: Grid, j: int) -> View:
    r0, nr, c0, nc = grid.sub(j)
    return View(buf, owner, base_row + r0, nr, c0, nc if grid.col_parts > 1 else -1)


def _emit_gather_pushes(bld: _Builder, stream: str, grid: Grid, channels: ChannelMap, fill_own: bool):
    """Push this rank's shard ``a`` (``grid.rows`` rows) into every peer's ``gather`` region at
    row block ``rank``. Step ``i`` goes to rank ``rank - i``, so at each step the ranks push to
    distinct peers, and rank ``d`` receives from ``d + 1, d + 2, ...``: the order it consumes."""
    r, w, rows = bld.rank, bld.world, grid.rows
    for i in range(1, w):
        dst = (r - i) % w
        for j in range(grid.count):
            bld.emit(Copy(stream, _sub_view("gather", dst, r * rows, grid, j), _sub_view("a", r, 0, grid, j)),
                     Put(stream, dst, channels.gather(j)))
    if fill_own:
        bld.emit(Copy(stream, View("gather", r, r * rows, rows), View("a", r, 0, rows)))


def _shard_groups(rank: int, world: int, group: int) -> list[tuple[int, int]]:
    """Remote shards in arrival order (``rank + 1, rank + 2, ...``) as ``(first, count)`` runs of
    at most ``group`` consecutive shards, cut at the wrap from ``world - 1`` to 0 so that every
    run is one contiguous block of rows (of ``gather`` and of ``out``)."""
    runs: list[list[int]] = []
    for i in range(1, world):
        s = (rank + i) % world
        if runs and len(runs[-1]) < group and runs[-1][-1] + 1 == s:
            runs[-1].append(s)
        else:
            runs.append([s])
    return [(run[0], len(run)) for run in runs]


def all_gather_matmul_plan(rank: int, world: int, grid: Grid, n: int, channels: ChannelMap, *,
                           bias: bool, fill_own: bool = False, gemm: bool = True, probe: bool = False,
                           alternate: bool = False, group: int = 1) -> Plan:
    """``out = all_gather(a) @ b (+ bias)``: ``a`` is this rank's ``[rows, K]`` shard, ``out`` is
    ``[world * rows, n]``. ``fill_own`` also copies ``a`` into this rank's own block of ``gather``
    (the whole gathered operand is then in ``gather`` after the call, for a weight gradient).
    ``gemm=False`` only gathers.

    Schedule (rank r): compute: GEMM(own shard from ``a``) while comm: barrier, then push to
    r-1, r-2, ...; then for s = r+1, r+2, ...: wait for s's shard, GEMM into out's block s.
    ``group > 1`` (unsplit shards only): up to ``group`` consecutive remote shards share one
    GEMM, which waits for all of them (:func:`.policy.gather_group`: small shards make
    inefficient GEMMs, and the own GEMM hides their transfers anyway).
    """
    bld = _Builder(rank, world, alternate and gemm)
    rows = grid.rows
    group = group if grid.count == 1 and gemm else 1
    bias_view = View("biasin", rank, 0, 1) if bias else None
    bld.fork(COMM, channels.barrier)
    # Issue order: the local GEMM before the pushes, so the compute stream never idles while the
    # host enqueues copies (GPU order between the streams is set by events/signals, not by this;
    # the pushes are bound by the transfers, not by their issue).
    if gemm:
        for j in range(grid.count):
            r0, nr, _, _ = grid.sub(j)
            bld.emit(Gemm(bld.gemm_stream(), View("out", rank, rank * rows + r0, nr), View("a", rank, r0, nr), 0, n,
                          bias=bias_view))
    _emit_gather_pushes(bld, COMM, grid, channels, fill_own)
    for first, count in _shard_groups(rank, world, group):
        for j in range(grid.count):
            r0, nr, _, _ = grid.sub(j)
            stream = bld.gemm_stream() if gemm else COMPUTE
            for src in range(first, first + count):
                bld.emit(Wait(stream, src, channels.gather(j)))
            if gemm:
                block = View("gather", rank, first * rows + r0, nr if count == 1 else count * rows)
                bld.emit(Gemm(stream, View("out", rank, block.row0, block.rows), block, 0, n, bias=bias_view))
    bld.join([COMM])
    if probe:
        if gemm:
            bld.emit(Probe(COMPUTE, View("out", rank, 0, world * rows), "out"))
        if fill_own or not gemm:
            bld.emit(Probe(COMPUTE, View("gather", rank, 0, world * rows), "gather"))
    shapes = {"a": (rows, None), "gather": (world * rows, None)}
    if gemm:
        shapes["out"] = (world * rows, n)
    if bias:
        shapes["biasin"] = (1, n)
    return Plan(rank, world, bld.out, shapes, bld.events, channels)


#: Bias placements of the reduce-scatter schedules: none, each rank's own bias on its partial
#: ("local", summed over ranks beforehand), or the chunk owner's bias once ("owner").
BIAS_MODES = (None, "local", "owner")


def _emit_side_gather(bld: _Builder, grid: Grid, channels: ChannelMap):
    """Gather buffer ``x`` into ``gather`` on comm2 (own block included). The barrier on comm
    already proved every peer's previous call finished; comm2 only starts after it."""
    rank, world = bld.rank, bld.world
    ev = bld.event()
    bld.emit(Record(COMM, ev), WaitEvent(COMM2, ev))
    for i in range(1, world):
        dst = (rank - i) % world
        for j in range(grid.count):
            bld.emit(Copy(COMM2, _sub_view("gather", dst, rank * grid.rows, grid, j), _sub_view("x", rank, 0, grid, j)),
                     Put(COMM2, dst, channels.gather(j)))
    bld.emit(Copy(COMM2, View("gather", rank, rank * grid.rows, grid.rows), View("x", rank, 0, grid.rows)))


def _emit_side_gather_waits(bld: _Builder, grid: Grid, channels: ChannelMap):
    for i in range(1, bld.world):
        for j in range(grid.count):
            bld.emit(Wait(COMPUTE, (bld.rank + i) % bld.world, channels.gather(j)))


def _ring_slot(grid: Grid, step: int, j: int) -> int:
    """Receive slot of ring step ``step`` (>= 1), sub-chunk ``j``: one slot per (step, sub-chunk),
    so a slot is written once per call."""
    return ((step - 1) * grid.count + j) * grid.sub_rows


def _finish_reduce_scatter(bld: _Builder, rank: int, world: int, rows: int, side_gather: Grid | None,
                           channels: ChannelMap, probe: bool) -> None:
    """Common tail of both reduce-scatter schedules: wait for the backward's side re-gather (if
    any), join the side streams into the compute stream, and emit the simulator's probes."""
    if side_gather is not None:
        _emit_side_gather_waits(bld, side_gather, channels)
    bld.join([COMM] + ([COMM2] if side_gather is not None else []))
    if probe:
        bld.emit(Probe(COMPUTE, View("out", rank, 0, rows), "out"))
        if side_gather is not None:
            bld.emit(Probe(COMPUTE, View("gather", rank, 0, world * side_gather.rows), "gather"))


def matmul_reduce_scatter_plan(rank: int, world: int, grid: Grid, channels: ChannelMap, *,
                               bias: Optional[str] = None, probe: bool = False,
                               side_gather: Optional[Grid] = None, alternate: bool = False) -> Plan:
    """``out = reduce_scatter(a @ b) (+ bias once)``: ``a`` is ``[world * rows, K]``, ``out`` is
    this rank's ``[rows, n]`` block of the sum (``grid`` = rows x n of one chunk).

    Ring (rank r, step i = 0 .. world-1, sub-chunk j): chunk ``c = (r + i + 1) % world``.
    Step 0 computes ``a[c] @ b (+ bias)`` into ``tmp``; step i >= 1 waits for rank r+1's step
    i-1 of the same chunk, which landed in a receive slot, and accumulates into it in the GEMM
    epilogue (``beta = 1``); steps < world-1 push their result to rank r-1; the last step's chunk
    is r's own: the comm stream copies the received sum into ``out`` and the GEMM accumulates
    onto it. Items run step-major, so with >= 2 sub-chunks a hop has one sub-GEMM of time to
    land before the next rank needs it.

    ``bias``: added once per output element, by the GEMM that starts each chain (step 0, the
    only one without an epilogue input). ``"local"``: this rank's ``biasin`` (every rank holds the
    same vector, e.g. the sum of all ranks' biases); ``"owner"``: the chunk owner's bias (a
    row-parallel bias added after the reduction, which need not be equal across ranks): each rank
    copies ``biasin`` into its ``bias`` slot at call start and signals rank r-1, whose step-0 GEMMs
    (chunk r) read it from peer memory. No barrier is needed for that slot: rank r's previous
    call ended after its own chunk, which needed r-1's step-0 GEMMs of that call.

    ``side_gather``: also gather ``a``-independent shard ``x`` (the caller binds it as buffer
    ``x``) into ``gather`` on stream comm2 (the column-parallel backward re-gathers its input for
    the weight gradient while the data-gradient ring runs); the compute stream waits for it at the
    end.
    """
    if bias not in BIAS_MODES:
        raise ValueError(f"matmul_reduce_scatter_plan: bias={bias!r}; accepted: {BIAS_MODES}")
    bld = _Builder(rank, world, alternate)
    rows, n, count = grid.rows, grid.cols, grid.count
    left, right = (rank - 1) % world, (rank + 1) % world
    bias_view = None
    if bias == "owner":
        bld.fork(COMM, None)
        bld.emit(Copy(COMM, View("bias", rank, 0, 1), View("biasin", rank, 0, 1)),
                 Put(COMM, left, channels.bias),
                 Barrier(COMM, channels.barrier))
        bias_view = View("bias", right, 0, 1)
    else:
        bld.fork(COMM, channels.barrier)
        bias_view = View("biasin", rank, 0, 1) if bias == "local" else None
    if side_gather is not None:
        _emit_side_gather(bld, side_gather, channels)
    own_ready = {}
    for step in range(world):
        chunk = (rank + step + 1) % world
        for j in range(count):
            item = step * count + j
            r0, nr, c0, nc = grid.sub(j)
            cols = nc if grid.col_parts > 1 else -1
            a_view = View("a", rank, chunk * rows + r0, nr)
            stream = bld.gemm_stream()
            if step == world - 1:
                # Own chunk: the received partial sum goes to out first (comm stream, overlapped
                # with the previous GEMM), then the GEMM adds onto out in place.
                dst = View("out", rank, r0, nr, c0, cols)
                bld.emit(WaitEvent(stream, own_ready[j]), Gemm(stream, dst, a_view, c0, nc, "acc"))
                continue
            if step == 0:
                dst = View("tmp", rank, j * grid.sub_rows, nr)
                if j == 0 and bias == "owner":
                    bld.emit(Wait(COMPUTE, right, channels.bias))
                    if alternate:  # the other GEMM stream reads the slot too
                        seen = bld.event()
                        bld.emit(Record(COMPUTE, seen), WaitEvent(AUX, seen))
                bld.emit(Gemm(stream, dst, a_view, c0, nc, "set", bias_view))
            else:
                dst = View("ring", rank, _ring_slot(grid, step, j), nr)
                bld.emit(Wait(stream, right, channels.ring(item - count)),
                         Gemm(stream, dst, a_view, c0, nc, "acc"))
            done = bld.event()
            bld.emit(Record(stream, done), WaitEvent(COMM, done),
                     Copy(COMM, View("ring", left, _ring_slot(grid, step + 1, j), nr), dst),
                     Put(COMM, left, channels.ring(item)))
            if step == world - 2:
                # Rank r+1 pushes its step world-2 of this sub-chunk (our own chunk) about now.
                ready = bld.event()
                bld.emit(Wait(COMM, right, channels.ring(item)),
                         Copy(COMM, View("out", rank, r0, nr, c0, cols),
                              View("ring", rank, _ring_slot(grid, world - 1, j), nr)),
                         Record(COMM, ready))
                own_ready[j] = ready
    _finish_reduce_scatter(bld, rank, world, rows, side_gather, channels, probe)
    shapes = {"a": (world * rows, None), "out": (rows, n), "tmp": (count * grid.sub_rows, grid.sub_cols),
              "ring": ((world - 1) * count * grid.sub_rows, grid.sub_cols)}
    if bias is not None:
        shapes["biasin"] = (1, n)
    if bias == "owner":
        shapes["bias"] = (1, n)
    if side_gather is not None:
        shapes["x"] = (side_gather.rows, None)
        shapes["gather"] = (world * side_gather.rows, None)
    return Plan(rank, world, bld.out, shapes, bld.events, channels)


def matmul_reduce_scatter_direct_plan(rank: int, world: int, rows: int, n: int, channels: ChannelMap, *,
                                      bias: bool = False, probe: bool = False,
                                      side_gather: Optional[Grid] = None, alternate: bool = False) -> Plan:
    """``out = reduce_scatter(a @ b) (+ bias)`` for small chunks: every rank GEMMs each peer's
    chunk whole (chunk ``r + 1`` first) into ``tmp`` and the comm stream pushes it into the
    owner's ``direct`` region at row block ``i`` = the sender's step (so the owner finds the
    partials in arrival order: block ``i`` comes from rank ``r - 1 - i``).

    The owner (``world >= 3``): between its pushes of steps ``world - 3`` and ``world - 2``, the
    comm stream waits for the partials of steps ``0 .. world - 3`` and sums them (+ ``biasin``,
    this rank's own bias) into ``out``, while the compute stream runs its last peer GEMM; the own
    GEMM (last) accumulates onto that sum in its epilogue (``beta = 1``); then the partial of step
    ``world - 2`` (rank r+1's last peer GEMM, pushed while r+1 runs its own GEMM) is added: the
    only exposed work, ``3 * rows * n`` elements of traffic. ``world == 2``: the own GEMM writes
    ``out`` (+ bias), then the one partial is added. No wait can cycle: every push a pre-sum
    waits for precedes the sender's own pre-sum on its comm stream.

    Chosen when the ring's sub-chunks would be too small to keep the GEMMs efficient (see
    :func:`.policy.rs_algorithm`). ``side_gather`` as in :func:`matmul_reduce_scatter_plan`.
    """
    bld = _Builder(rank, world, alternate)
    bld.fork(COMM, channels.barrier)
    if side_gather is not None:
        _emit_side_gather(bld, side_gather, channels)
    out = View("out", rank, 0, rows)
    bias_view = View("biasin", rank, 0, 1) if bias else None
    own = View("a", rank, rank * rows, rows)
    presum = world > 2
    for i in range(world - 1):
        chunk = (rank + i + 1) % world
        dst = View("tmp", rank, i * rows, rows)
        done = bld.event()
        stream = bld.gemm_stream()
        bld.emit(Gemm(stream, dst, View("a", rank, chunk * rows, rows), 0, n), Record(stream, done))
        if presum and i == world - 2:
            # A sender's step-s partial lands ~(s + 1) chunk GEMMs + one transfer into the call,
            # so those of steps 0 .. world-3 are here about when our push of step world-3 is
            # done: sum them now, while the last peer GEMM runs (the own GEMM needs the sum).
            ready = bld.event()
            for step in range(world - 2):
                bld.emit(Wait(COMM, (rank - 1 - step) % world, channels.ring(0)))
            bld.emit(Sum(COMM, out, View("direct", rank, 0, (world - 2) * rows), world - 2, bias=bias_view),
                     Record(COMM, ready))
        bld.emit(WaitEvent(COMM, done),
                 Copy(COMM, View("direct", chunk, i * rows, rows), dst),
                 Put(COMM, chunk, channels.ring(0)))
    # The own GEMM stays on compute, where the final add that reads its result runs.
    if presum:
        bld.emit(WaitEvent(COMPUTE, ready), Gemm(COMPUTE, out, own, 0, n, "acc"))
    else:
        bld.emit(Gemm(COMPUTE, out, own, 0, n, bias=bias_view))
    bld.emit(Wait(COMPUTE, (rank + 1) % world, channels.ring(0)),
             Sum(COMPUTE, out, View("direct", rank, (world - 2) * rows, rows), 1, acc=True))
    _finish_reduce_scatter(bld, rank, world, rows, side_gather, channels, probe)
    shapes = {"a": (world * rows, None), "out": (rows, n), "tmp": ((world - 1) * rows, n),
              "direct": ((world - 1) * rows, n)}
    if bias:
        shapes["biasin"] = (1, n)
    if side_gather is not None:
        shapes["x"] = (side_gather.rows, None)
        shapes["gather"] = (world * side_gather.rows, None)
    return Plan(rank, world, bld.out, shapes, bld.events, channels)
