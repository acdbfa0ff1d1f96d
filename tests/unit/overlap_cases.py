"""Plans and simulated runs of the comm + GEMM overlap schedules, shared by test_overlap_plan.py and
test_overlap_simulator.py."""

import torch

from opfuse.families.collective_linear.overlap import policy
from opfuse.families.collective_linear.overlap import schedules as S
from opfuse.families.collective_linear.overlap.simulate import simulate

SEEDS = range(6)


def _randn(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _nan(*shape):
    return torch.full(shape, float("nan"), dtype=torch.float64)


def _ag_plans(world, grid, n, *, bias, fill_own=False, alternate=True):
    channels = policy.channel_map(world, grid, None)
    return [S.all_gather_matmul_plan(r, world, grid, n, channels, bias=bias, fill_own=fill_own, probe=True,
                                     alternate=alternate) for r in range(world)]


def _rs_plans(world, grid, *, bias=None, side_gather=None, alternate=True):
    channels = policy.channel_map(world, side_gather, grid)
    return [S.matmul_reduce_scatter_plan(r, world, grid, channels, bias=bias, probe=True, side_gather=side_gather,
                                         alternate=alternate) for r in range(world)]


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
