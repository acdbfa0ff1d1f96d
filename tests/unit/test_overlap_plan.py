"""The comm + GEMM overlap schedules, checked on CPU: chunk planning, plan well-formedness, and a
multi-rank, multi-stream, multi-call simulation in random interleavings (no deadlock, no race,
every output element equal to the unpipelined math)."""

import pytest
import torch

from opfuse.families.collective_linear.overlap import plan as P
from opfuse.families.collective_linear.overlap import schedules as S
from opfuse.families.collective_linear.overlap import policy
from opfuse.families.collective_linear.overlap.simulate import simulate

from .overlap_cases import SEEDS, _ag_plans, _nan, _randn, _rs_plans, _run_ag, _run_rs


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
