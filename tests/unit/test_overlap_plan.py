"""The comm + GEMM overlap schedules, checked on CPU: chunk planning, plan well-formedness, and a
multi-rank, multi-stream, multi-call simulation in random interleavings (no deadlock, no race,
every output element equal to the unpipelined math)."""

import itertools

import pytest
import torch

from opfuse.families.collective_linear.overlap import plan as P
from opfuse.families.collective_linear.overlap import schedules as S
from opfuse.families.collective_linear.overlap import policy
from opfuse.families.collective_linear.overlap.simulate import Deadlock, Race, simulate

SEEDS = range(6)


def _randn(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _nan(*shape):
    return torch.full(shape, float("nan"), dtype=torch.float64)


# Policy ---------------------------------------------------------------------------------------


def test_ring_grid_auto_splits_rows_when_large_and_columns_when_small():
    assert policy.ring_grid(2048, 8192) == policy.Grid(2048, 8192, 2, 1)
    assert policy.ring_grid(1024, 8192) == policy.Grid(1024, 8192, 2, 1)
    assert policy.ring_grid(512, 8192) == policy.Grid(512, 8192, 1, 2)
    assert policy.ring_grid(8, 6) == policy.Grid(8, 6, 1, 2)


def test_ring_grid_falls_back_when_nothing_divides():
    assert policy.ring_grid(7, 5).count == 1
    assert policy.ring_grid(9, 5, setting=3) == policy.Grid(9, 5, 3, 1)
    assert policy.ring_grid(4096, 8192, setting=4) == policy.Grid(4096, 8192, 4, 1)
    assert policy.ring_grid(1024, 8192, setting=4) == policy.Grid(1024, 8192, 1, 4)


def test_gather_grid():
    assert policy.gather_grid(512, 8192).count == 1
    assert policy.gather_grid(512, 8192, setting=2) == policy.Grid(512, 8192, 2, 1)
    assert policy.gather_grid(5, 8, setting=2).count == 1


def test_grid_subchunks_tile_the_chunk():
    grid = policy.Grid(6, 10, 3, 2)
    covered = torch.zeros(6, 10, dtype=torch.int64)
    for j in range(grid.count):
        r0, nr, c0, nc = grid.sub(j)
        covered[r0:r0 + nr, c0:c0 + nc] += 1
    assert bool((covered == 1).all())
    with pytest.raises(ValueError):
        policy.Grid(5, 10, 2, 1)


def test_channel_map_is_disjoint_and_sized():
    channels = policy.channel_map(4, policy.Grid(8, 8, 2, 1), policy.Grid(8, 8, 1, 2))
    used = ([channels.barrier, channels.bias] + [channels.gather(j) for j in range(2)]
            + [channels.ring(i) for i in range(6)])
    assert len(set(used)) == len(used) == channels.end - policy.CHANNEL_BASE
    assert min(used) == policy.CHANNEL_BASE
    assert policy.ChannelMap.available(2048, 8) == 64


def test_region_bytes():
    assert policy.gather_region_bytes(4, 2048, 8192, 2) == 8192 * 8192 * 2
    assert policy.ring_region_bytes(4, 2048, 8192, 2) == 3 * 2048 * 8192 * 2
    assert policy.direct_region_bytes(4, 512, 8192, 2) == 3 * 512 * 8192 * 2  # the peers' partials only


# Plans ------------------------------------------------------------------------------------------


def _ag_plans(world, grid, n, *, bias, fill_own=False, alternate=True):
    channels = policy.channel_map(world, grid, None)
    return [S.all_gather_matmul_plan(r, world, grid, n, channels, bias=bias, fill_own=fill_own, probe=True,
                                     alternate=alternate) for r in range(world)]


def _rs_plans(world, grid, *, bias=None, side_gather=None, alternate=True):
    channels = policy.channel_map(world, side_gather, grid)
    return [S.matmul_reduce_scatter_plan(r, world, grid, channels, bias=bias, probe=True, side_gather=side_gather,
                                         alternate=alternate) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_plans_validate(world):
    for plan in _ag_plans(world, policy.Grid(4, 6, 2, 1), 5, bias=True, fill_own=True):
        P.validate(plan)
    for plan in _rs_plans(world, policy.Grid(4, 6, 1, 2), bias="owner", side_gather=policy.Grid(4, 3)):
        P.validate(plan)


def test_validate_rejects_wait_before_record():
    bad = P.Plan(0, 2, [P.WaitEvent(P.COMM, 0), P.Record(P.COMPUTE, 0)], {})
    with pytest.raises(ValueError, match="before it is recorded"):
        P.validate(bad)


def test_signals_balance_per_call():
    """Every put has exactly one matching wait on the receiver in the same call, so calls can be
    replayed (CUDA graphs) with no host-side state."""
    world = 4
    plans = _rs_plans(world, policy.Grid(4, 6, 2, 1), bias="owner", side_gather=policy.Grid(4, 3))
    puts, waits = {}, {}
    for plan in plans:
        for ins in plan.instructions:
            if isinstance(ins, P.Put):
                puts[(plan.rank, ins.peer, ins.channel)] = puts.get((plan.rank, ins.peer, ins.channel), 0) + 1
            elif isinstance(ins, P.Wait):
                waits[(ins.peer, plan.rank, ins.channel)] = waits.get((ins.peer, plan.rank, ins.channel), 0) + 1
    assert puts == waits
    assert set(puts.values()) == {1}


def test_ring_pushes_only_to_left_neighbour_and_gather_to_all():
    world = 4
    for plan in _rs_plans(world, policy.Grid(4, 6, 2, 1)):
        peers = {ins.dst.owner for ins in plan.instructions if isinstance(ins, P.Copy) and ins.dst.owner != plan.rank}
        assert peers == {(plan.rank - 1) % world}
    for plan in _ag_plans(world, policy.Grid(4, 6), 5, bias=False):
        peers = [ins.dst.owner for ins in plan.instructions if isinstance(ins, P.Copy) and ins.dst.owner != plan.rank]
        assert peers == [(plan.rank - i) % world for i in range(1, world)]


def test_gemms_cover_every_output_element_once_per_rank():
    world, grid = 3, policy.Grid(4, 6, 1, 2)
    for plan in _rs_plans(world, grid, bias="owner"):
        bias_adds = sum(1 for i in plan.instructions if isinstance(i, P.Gemm) and i.bias is not None)
        assert bias_adds == grid.count  # one chain start per sub-chunk per rank = bias once per element
        own = [i for i in plan.instructions if isinstance(i, P.Gemm) and i.dst.buf == "out"]
        cover = torch.zeros(4, 6, dtype=torch.int64)
        for g in own:
            cover[g.dst.row0:g.dst.row0 + g.dst.rows, g.dst.col0:g.dst.col0 + g.dst.cols] += 1
        assert bool((cover == 1).all())


# Simulation ------------------------------------------------------------------------------------


def _run_ag(world, grid, k, n, *, bias, fill_own, calls, seed, alternate=True):
    gen = torch.Generator().manual_seed(1000 + seed)
    plans = [_ag_plans(world, grid, n, bias=bias, fill_own=fill_own, alternate=alternate) for _ in range(calls)]
    buffers = [[{"a": _randn(grid.rows, k, gen=gen), "b": _randn(k, n, gen=gen), "biasin": _randn(1, n, gen=gen),
                 "out": _nan(world * grid.rows, n)} for _ in range(world)] for _ in range(calls)]
    regions = [{"gather": _nan(world * grid.rows, k)} for _ in range(world)]
    probes = simulate(plans, buffers, regions, seed=seed)
    for call in range(calls):
        full = torch.cat([buffers[call][p]["a"] for p in range(world)])
        for r in range(world):
            ref = full @ buffers[call][r]["b"] + (buffers[call][r]["biasin"][0] if bias else 0)
            torch.testing.assert_close(probes[(call, r, "out")], ref, rtol=1e-12, atol=1e-12)
            if fill_own:
                torch.testing.assert_close(probes[(call, r, "gather")], full, rtol=0, atol=0)


def _run_rs(world, grid, k, *, bias, calls, seed, side_gather=None, xk=3, alternate=True):
    gen = torch.Generator().manual_seed(2000 + seed)
    n = grid.cols
    plans = [_rs_plans(world, grid, bias=bias, side_gather=side_gather, alternate=alternate) for _ in range(calls)]
    # "local": every rank holds the same vector; "owner": each rank's own bias, added to its chunk.
    shared_bias = [_randn(1, n, gen=gen) for _ in range(calls)]
    # ``tmp`` belongs to the bound plan (one per rank, reused by every call), the rest is per call.
    tmps = [_nan(grid.count * grid.sub_rows, grid.sub_cols) for _ in range(world)]
    buffers = [[{"a": _randn(world * grid.rows, k, gen=gen), "b": _randn(k, n, gen=gen),
                 "biasin": shared_bias[c] if bias == "local" else _randn(1, n, gen=gen),
                 "out": _nan(grid.rows, n), "tmp": tmps[r]}
                for r in range(world)] for c in range(calls)]
    regions = [{"ring": _nan((world - 1) * grid.count * grid.sub_rows, grid.sub_cols), "bias": _nan(1, n)}
               for _ in range(world)]
    if side_gather is not None:
        for call in range(calls):
            for r in range(world):
                buffers[call][r]["x"] = _randn(side_gather.rows, xk, gen=gen)
        for r in range(world):
            regions[r]["gather"] = _nan(world * side_gather.rows, xk)
    probes = simulate(plans, buffers, regions, seed=seed)
    rows = grid.rows
    for call in range(calls):
        for r in range(world):
            ref = sum(buffers[call][p]["a"][r * rows:(r + 1) * rows] @ buffers[call][p]["b"] for p in range(world))
            if bias is not None:
                ref = ref + buffers[call][r]["biasin"][0]
            torch.testing.assert_close(probes[(call, r, "out")], ref, rtol=1e-12, atol=1e-12)
            if side_gather is not None:
                full = torch.cat([buffers[call][p]["x"] for p in range(world)])
                torch.testing.assert_close(probes[(call, r, "gather")], full, rtol=0, atol=0)


@pytest.mark.parametrize("world,grid,bias,fill_own", [
    (2, policy.Grid(3, 4), True, False),
    (3, policy.Grid(4, 4, 2, 1), False, True),
    (4, policy.Grid(2, 4), True, True),
    (4, policy.Grid(4, 4, 4, 1), False, False),
])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("alternate", [False, True])
def test_all_gather_matmul_schedule(world, grid, bias, fill_own, seed, alternate):
    _run_ag(world, grid, k=grid.cols, n=5, bias=bias, fill_own=fill_own, calls=3, seed=seed, alternate=alternate)


@pytest.mark.parametrize("world,grid,bias", [
    (2, policy.Grid(4, 6, 2, 1), "owner"),
    (2, policy.Grid(4, 6), None),
    (3, policy.Grid(4, 6, 1, 2), "local"),
    (4, policy.Grid(4, 6, 2, 1), None),
    (4, policy.Grid(2, 6, 1, 3), "owner"),
    (4, policy.Grid(2, 6, 1, 2), "local"),
    (5, policy.Grid(2, 4, 1, 2), "owner"),
])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("alternate", [False, True])
def test_matmul_reduce_scatter_schedule(world, grid, bias, seed, alternate):
    _run_rs(world, grid, k=5, bias=bias, calls=3, seed=seed, alternate=alternate)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("seed", SEEDS)
def test_column_backward_schedule_ring_with_side_gather(world, seed):
    _run_rs(world, policy.Grid(4, 6, 2, 1), k=5, bias=None, calls=3, seed=seed,
            side_gather=policy.Grid(4, 3, 2, 1))


@pytest.mark.parametrize("seed", SEEDS)
def test_layers_sharing_regions_back_to_back(seed):
    """Forward AG+GEMM, backward (ring + re-gather) and the next forward share the gather region,
    as layers of one shape do: no call may overwrite what a slower peer still reads."""
    world, rows, k, n = 3, 4, 6, 5
    gen = torch.Generator().manual_seed(3000 + seed)
    ag_grid, ring_grid = policy.Grid(rows, k), policy.Grid(rows, k, 2, 1)
    channels = policy.channel_map(world, ag_grid, ring_grid)
    tmps = [_nan(ring_grid.count * ring_grid.sub_rows, k) for _ in range(world)]
    plans, buffers = [], []
    for call in range(4):
        per_rank, bufs = [], []
        for r in range(world):
            if call % 2 == 0:
                per_rank.append(S.all_gather_matmul_plan(r, world, ag_grid, n, channels, bias=False, probe=True))
                bufs.append({"a": _randn(rows, k, gen=gen), "b": _randn(k, n, gen=gen), "out": _nan(world * rows, n)})
            else:
                per_rank.append(S.matmul_reduce_scatter_plan(r, world, ring_grid, channels, probe=True,
                                                             side_gather=ag_grid))
                bufs.append({"a": _randn(world * rows, n, gen=gen), "b": _randn(n, k, gen=gen),
                             "x": _randn(rows, k, gen=gen), "out": _nan(rows, k), "tmp": tmps[r]})
        plans.append(per_rank)
        buffers.append(bufs)
    regions = [{"gather": _nan(world * rows, k), "ring": _nan((world - 1) * rows, k)} for _ in range(world)]
    probes = simulate(plans, buffers, regions, seed=seed)
    for call in range(4):
        for r in range(world):
            b = buffers[call]
            if call % 2 == 0:
                ref = torch.cat([b[p]["a"] for p in range(world)]) @ b[r]["b"]
            else:
                ref = sum(b[p]["a"][r * rows:(r + 1) * rows] @ b[p]["b"] for p in range(world))
                torch.testing.assert_close(probes[(call, r, "gather")], torch.cat([b[p]["x"] for p in range(world)]))
            torch.testing.assert_close(probes[(call, r, "out")], ref, rtol=1e-12, atol=1e-12)


# The simulator itself catches what it claims to -------------------------------------------------


def test_simulator_detects_deadlock():
    plans = [[P.Plan(0, 2, [P.Wait(P.COMPUTE, 1, 9)], {}), P.Plan(1, 2, [P.Wait(P.COMPUTE, 0, 9)], {})]]
    with pytest.raises(Deadlock):
        simulate(plans, [[{}, {}]], [{}, {}])


def test_simulator_detects_missing_wait():
    """Dropping the consumer's wait_signal makes the schedule read a peer's data before it lands:
    the simulation must fail (NaN/garbage in the output or a race) for some interleaving."""
    world, grid = 2, policy.Grid(2, 3)
    failures = 0
    for seed in range(20):
        plans = _ag_plans(world, grid, 4, bias=False)
        for plan in plans:
            plan.instructions = [i for i in plan.instructions if not isinstance(i, P.Wait)]
        # The puts now have no consumer: drop them too, or the next call's put would spin forever.
        for plan in plans:
            plan.instructions = [i for i in plan.instructions if not isinstance(i, P.Put)]
        try:
            _check_ag_once(plans, world, grid, seed)
        except (AssertionError, Race):
            failures += 1
    assert failures > 0


def _check_ag_once(plans, world, grid, seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = [{"a": _randn(grid.rows, grid.cols, gen=gen), "b": _randn(grid.cols, 4, gen=gen),
             "out": _nan(world * grid.rows, 4)} for _ in range(world)]
    regions = [{"gather": _nan(world * grid.rows, grid.cols)} for _ in range(world)]
    probes = simulate([plans], [bufs], regions, seed=seed)
    full = torch.cat([b["a"] for b in bufs])
    for r in range(world):
        torch.testing.assert_close(probes[(0, r, "out")], full @ bufs[r]["b"])


def _drop_barrier(ins):
    return [i for i in ins if not isinstance(i, P.Barrier)]


def _drop_join(ins):
    """Remove the final Record(comm) / WaitEvent(compute) pair."""
    last = max(k for k, i in enumerate(ins) if isinstance(i, P.Record) and i.stream == P.COMM)
    return ins[:last] + ins[last + 2:]


def _drop_gemm_before_push(ins):
    """The comm stream pushes a partial sum without waiting for the GEMM that produces it."""
    return [i for i in ins if not (isinstance(i, P.WaitEvent) and i.stream == P.COMM and i.event != 0)]


def _drop_own_ready(ins):
    """The own-chunk GEMM does not wait for the received partial sum to be copied into out."""
    return [i for k, i in enumerate(ins)
            if not (isinstance(i, P.WaitEvent) and i.stream == P.COMPUTE and k + 1 < len(ins)
                    and isinstance(ins[k + 1], P.Gemm) and ins[k + 1].dst.buf == "out")]


def _drop_bias_wait(ins):
    """The chain start reads the owner's bias slot without waiting for it."""
    return [i for i in ins if not (isinstance(i, P.Wait) and i.channel == policy.CHANNEL_BASE + 1)]


@pytest.mark.parametrize("mutation,bias", [(_drop_barrier, None), (_drop_gemm_before_push, None),
                                           (_drop_own_ready, None), (_drop_bias_wait, "owner")])
def test_simulator_catches_broken_ring_schedules(mutation, bias):
    """Each synchronisation step of the ring is necessary: removing it must make some random
    interleaving of three calls fail (wrong output, race or deadlock). (With an owner bias, the
    bias signals alone happen to order consecutive calls at world 3, so the barrier case runs
    without bias.) (The ring's join is implied by its own-chunk events, which follow every push on
    the comm stream, so it is not in this list.)"""
    world, grid = 3, policy.Grid(2, 4, 1, 2)
    failures = 0
    for seed in range(30):
        plans_per_call = [_rs_plans(world, grid, bias=bias) for _ in range(3)]
        for plans in plans_per_call:
            for plan in plans:
                plan.instructions = mutation(plan.instructions)
        gen = torch.Generator().manual_seed(seed)
        tmps = [_nan(grid.count * grid.sub_rows, grid.sub_cols) for _ in range(world)]
        buffers = [[{"a": _randn(world * grid.rows, 3, gen=gen), "b": _randn(3, grid.cols, gen=gen),
                     "biasin": _randn(1, grid.cols, gen=gen), "out": _nan(grid.rows, grid.cols), "tmp": tmps[r]}
                    for r in range(world)] for _ in range(3)]
        regions = [{"ring": _nan((world - 1) * grid.count * grid.sub_rows, grid.sub_cols),
                    "bias": _nan(1, grid.cols)} for _ in range(world)]
        try:
            probes = simulate(plans_per_call, buffers, regions, seed=seed)
            for call, r in itertools.product(range(3), range(world)):
                ref = sum(buffers[call][p]["a"][r * grid.rows:(r + 1) * grid.rows] @ buffers[call][p]["b"]
                          for p in range(world))
                if bias is not None:
                    ref = ref + buffers[call][r]["biasin"][0]
                torch.testing.assert_close(probes[(call, r, "out")], ref)
        except (AssertionError, Race, Deadlock):
            failures += 1
    assert failures > 0


@pytest.mark.parametrize("mutation", [_drop_barrier, _drop_join])
def test_simulator_catches_broken_gather_schedules(mutation):
    """Without the barrier a fast rank overwrites a gather slot a slow peer still reads; without
    the join the gathered operand (own block copied on the comm stream) is read too early."""
    world, grid = 3, policy.Grid(2, 3)
    failures = 0
    for seed in range(30):
        plans_per_call = [_ag_plans(world, grid, 4, bias=False, fill_own=True) for _ in range(3)]
        for plans in plans_per_call:
            for plan in plans:
                plan.instructions = mutation(plan.instructions)
        try:
            gen = torch.Generator().manual_seed(seed)
            buffers = [[{"a": _randn(grid.rows, grid.cols, gen=gen), "b": _randn(grid.cols, 4, gen=gen),
                         "out": _nan(world * grid.rows, 4)} for _ in range(world)] for _ in range(3)]
            regions = [{"gather": _nan(world * grid.rows, grid.cols)} for _ in range(world)]
            probes = simulate(plans_per_call, buffers, regions, seed=seed)
            for call, r in itertools.product(range(3), range(world)):
                full = torch.cat([buffers[call][p]["a"] for p in range(world)])
                torch.testing.assert_close(probes[(call, r, "out")], full @ buffers[call][r]["b"])
                torch.testing.assert_close(probes[(call, r, "gather")], full)
        except (AssertionError, Race, Deadlock):
            failures += 1
    assert failures > 0


# Direct reduce-scatter (small chunks) ------------------------------------------------------------


def test_rs_algorithm_choice():
    assert policy.rs_algorithm(2048, 8192) == ("ring", policy.Grid(2048, 8192, 2, 1))
    assert policy.rs_algorithm(1024, 8192) == ("ring", policy.Grid(1024, 8192, 2, 1))
    assert policy.rs_algorithm(512, 8192)[0] == "direct"
    assert policy.rs_algorithm(4096, 8192, setting=1)[0] == "direct"
    assert policy.rs_algorithm(512, 8192, setting=2) == ("ring", policy.Grid(512, 8192, 1, 2))
    assert policy.rs_algorithm(7, 5, setting=2)[0] == "direct"  # nothing divides: never a slack-less ring


def _direct_plans(world, rows, n, *, bias=False, side_gather=None, alternate=True):
    channels = policy.channel_map(world, side_gather, None, direct=True)
    return [S.matmul_reduce_scatter_direct_plan(r, world, rows, n, channels, bias=bias, probe=True,
                                                side_gather=side_gather, alternate=alternate) for r in range(world)]


@pytest.mark.parametrize("world,rows,bias,side", [(2, 3, True, None), (3, 2, False, policy.Grid(2, 4)),
                                                  (4, 2, True, policy.Grid(2, 4, 2, 1)), (5, 1, False, None)])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("alternate", [False, True])
def test_direct_reduce_scatter_schedule(world, rows, bias, side, seed, alternate):
    gen = torch.Generator().manual_seed(4000 + seed)
    n, k, calls = 6, 5, 3
    plans = [_direct_plans(world, rows, n, bias=bias, side_gather=side, alternate=alternate) for _ in range(calls)]
    for plan in plans[0]:
        P.validate(plan)
    tmps = [_nan((world - 1) * rows, n) for _ in range(world)]  # persistent, as in the executor
    buffers = [[{"a": _randn(world * rows, k, gen=gen), "b": _randn(k, n, gen=gen), "biasin": _randn(1, n, gen=gen),
                 "out": _nan(rows, n), "tmp": tmps[r],
                 **({"x": _randn(side.rows, 3, gen=gen)} if side else {})} for r in range(world)] for _ in range(calls)]
    regions = [{"direct": _nan((world - 1) * rows, n), **({"gather": _nan(world * side.rows, 3)} if side else {})}
               for _ in range(world)]
    probes = simulate(plans, buffers, regions, seed=seed)
    for call in range(calls):
        b = buffers[call]
        for r in range(world):
            ref = sum(b[p]["a"][r * rows:(r + 1) * rows] @ b[p]["b"] for p in range(world))
            if bias:
                ref = ref + b[r]["biasin"][0]
            torch.testing.assert_close(probes[(call, r, "out")], ref, rtol=1e-12, atol=1e-12)
            if side:
                torch.testing.assert_close(probes[(call, r, "gather")], torch.cat([b[p]["x"] for p in range(world)]))


def _drop_presum_waits(ins):
    """The pre-sum reads the early partials without waiting for their signals."""
    return [i for i in ins if not (isinstance(i, P.Wait) and i.stream == P.COMM)]


def _drop_final_wait(ins):
    """The final add reads the last sender's partial without waiting for its signal."""
    return [i for i in ins if not (isinstance(i, P.Wait) and i.stream == P.COMPUTE)]


@pytest.mark.parametrize("mutation,world", [
    # At world 3 the pre-sum chain alone happens to order consecutive calls (rank c's pre-sum ->
    # its last push -> rank c-1's final add -> c-1's next call); from world 4 the barrier is needed.
    (_drop_barrier, 4), (_drop_gemm_before_push, 3), (_drop_own_ready, 3), (_drop_own_ready, 4),
    (_drop_presum_waits, 4), (_drop_final_wait, 2), (_drop_final_wait, 3),
    # Without the join, the next call's last peer GEMM overwrites the plan's staging buffer
    # (persistent across calls) while the comm stream may still push it.
    (_drop_join, 3), (_drop_join, 4)])
def test_simulator_catches_broken_direct_schedules(mutation, world):
    rows, n = 2, 4
    failures = 0
    for seed in range(30):
        plans_per_call = [_direct_plans(world, rows, n) for _ in range(3)]
        for plans in plans_per_call:
            for plan in plans:
                plan.instructions = mutation(plan.instructions)
        gen = torch.Generator().manual_seed(seed)
        tmps = [_nan((world - 1) * rows, n) for _ in range(world)]
        buffers = [[{"a": _randn(world * rows, 3, gen=gen), "b": _randn(3, n, gen=gen), "out": _nan(rows, n),
                     "tmp": tmps[r]} for r in range(world)] for _ in range(3)]
        regions = [{"direct": _nan((world - 1) * rows, n)} for _ in range(world)]
        try:
            probes = simulate(plans_per_call, buffers, regions, seed=seed)
            for call, r in itertools.product(range(3), range(world)):
                ref = sum(buffers[call][p]["a"][r * rows:(r + 1) * rows] @ buffers[call][p]["b"] for p in range(world))
                torch.testing.assert_close(probes[(call, r, "out")], ref)
        except (AssertionError, Race, Deadlock):
            failures += 1
    assert failures > 0


@pytest.mark.parametrize("world", [3, 8])
@pytest.mark.parametrize("seed,alternate", [(0, False), (1, True)])
def test_sequence_parallel_training_step_back_to_back(world, seed, alternate):
    """The four overlap calls of a sequence-parallel MLP training step, as the GPU block test runs
    them, for two steps: all-gather + GEMM (bias), direct reduce-scatter (bias), the backward
    gather with ``fill_own``, the direct reduce-scatter with the side re-gather; the gather and
    direct regions shared between them, as layers of one shape share them."""
    rows, hidden, ffn = 2, 3, 4
    gen = torch.Generator().manual_seed(5000 + seed)
    g = policy.Grid(rows, hidden)
    ch_ag, ch_d = policy.channel_map(world, g, None), policy.channel_map(world, None, None, direct=True)
    ch_ds = policy.channel_map(world, g, None, direct=True)
    tmp_f = [_nan((world - 1) * rows, hidden) for _ in range(world)]
    tmp_b = [_nan((world - 1) * rows, hidden) for _ in range(world)]
    plans, buffers, kinds = [], [], []
    for _ in range(2):
        plans.append([S.all_gather_matmul_plan(r, world, g, ffn, ch_ag, bias=True, probe=True, alternate=alternate,
                                               group=world) for r in range(world)])
        buffers.append([{"a": _randn(rows, hidden, gen=gen), "b": _randn(hidden, ffn, gen=gen),
                         "biasin": _randn(1, ffn, gen=gen), "out": _nan(world * rows, ffn)} for _ in range(world)])
        plans.append([S.matmul_reduce_scatter_direct_plan(r, world, rows, hidden, ch_d, bias=True, probe=True,
                                                          alternate=alternate) for r in range(world)])
        buffers.append([{"a": _randn(world * rows, ffn, gen=gen), "b": _randn(ffn, hidden, gen=gen),
                         "biasin": _randn(1, hidden, gen=gen), "out": _nan(rows, hidden), "tmp": tmp_f[r]}
                        for r in range(world)])
        plans.append([S.all_gather_matmul_plan(r, world, g, ffn, ch_ag, bias=False, fill_own=True, probe=True,
                                               alternate=alternate, group=world) for r in range(world)])
        buffers.append([{"a": _randn(rows, hidden, gen=gen), "b": _randn(hidden, ffn, gen=gen),
                         "out": _nan(world * rows, ffn)} for _ in range(world)])
        plans.append([S.matmul_reduce_scatter_direct_plan(r, world, rows, hidden, ch_ds, probe=True, side_gather=g,
                                                          alternate=alternate) for r in range(world)])
        buffers.append([{"a": _randn(world * rows, ffn, gen=gen), "b": _randn(ffn, hidden, gen=gen),
                         "out": _nan(rows, hidden), "tmp": tmp_b[r], "x": _randn(rows, hidden, gen=gen)}
                        for r in range(world)])
        kinds += ["ag_fwd", "rs_fwd", "ag_bwd", "rs_bwd"]
    regions = [{"gather": _nan(world * rows, hidden), "direct": _nan((world - 1) * rows, hidden)}
               for _ in range(world)]
    probes = simulate(plans, buffers, regions, seed=seed)
    for call, kind in enumerate(kinds):
        b = buffers[call]
        for r in range(world):
            if kind.startswith("ag"):
                full = torch.cat([b[p]["a"] for p in range(world)])
                ref = full @ b[r]["b"] + (b[r]["biasin"][0] if kind == "ag_fwd" else 0)
                if kind == "ag_bwd":
                    torch.testing.assert_close(probes[(call, r, "gather")], full, rtol=0, atol=0)
            else:
                ref = sum(b[p]["a"][r * rows:(r + 1) * rows] @ b[p]["b"] for p in range(world))
                ref = ref + (b[r]["biasin"][0] if kind == "rs_fwd" else 0)
                if kind == "rs_bwd":
                    torch.testing.assert_close(probes[(call, r, "gather")], torch.cat([b[p]["x"] for p in range(world)]),
                                               rtol=0, atol=0)
            torch.testing.assert_close(probes[(call, r, "out")], ref, rtol=1e-12, atol=1e-12)
