"""The overlap simulator catches the bugs it claims to (deadlocks, missing waits, schedules with a
dropped barrier, join or wait), the direct reduce-scatter of small chunks, and back-to-back
sequence-parallel training steps, on CPU (the helpers: overlap_cases.py)."""

import itertools

import pytest
import torch

from opfuse.families.collective_linear.overlap import plan as P
from opfuse.families.collective_linear.overlap import schedules as S
from opfuse.families.collective_linear.overlap import policy
from opfuse.families.collective_linear.overlap.simulate import Deadlock, Race, simulate

from .overlap_cases import SEEDS, _ag_plans, _nan, _randn, _rs_plans


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


@pytest.mark.parametrize("world,rows,chunks", [(2, 5, 1), (3, 4, 2), (4, 1, 1), (8, 3, 1)])
def test_gather_only_plan_gathers_every_shard_back_to_back(world, rows, chunks):
    """The plan of ``all_gather_tokens`` (``gemm=False``, ``fill_own``): after each of three calls
    with fresh shards, every rank's gathered region is the concatenation of the shards, rank-major,
    bit for bit, under random interleavings of the streams (a missing wait or barrier shows up as a
    NaN, a stale shard or a race)."""
    k, calls = 6, 3
    for seed in SEEDS[:3]:
        grid = policy.Grid(rows, k) if chunks == 1 else policy.Grid(rows, k, chunks)
        channels = policy.channel_map(world, grid, None)
        plans = [[S.all_gather_matmul_plan(r, world, grid, 0, channels, bias=False, fill_own=True, gemm=False,
                                           probe=True) for r in range(world)] for _ in range(calls)]
        gen = torch.Generator().manual_seed(seed)
        buffers = [[{"a": _randn(rows, k, gen=gen)} for _ in range(world)] for _ in range(calls)]
        regions = [{"gather": _nan(world * rows, k)} for _ in range(world)]
        probes = simulate(plans, buffers, regions, seed=seed)
        for call in range(calls):
            full = torch.cat([buffers[call][p]["a"] for p in range(world)])
            for r in range(world):
                torch.testing.assert_close(probes[(call, r, "gather")], full, rtol=0, atol=0)
