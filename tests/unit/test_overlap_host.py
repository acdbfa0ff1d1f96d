"""Host-side cost of the compiled overlap plans (CPU, fake CUDA primitives): each instruction is
exactly one call into torch / CUDA, stream switches only where the stream changes, static
operands are constants of the compiled function, and the bench cases stay within their call
budgets (docs/PERF_NOTES.overlap.md, "Host overhead")."""

import pytest
import torch

from opfuse.families.collective_linear.overlap import executor, policy, schedules
from opfuse.families.collective_linear.overlap import plan as P
from opfuse.families.collective_linear.overlap.cpu_binding import CpuRegion, NoOpApi, bind, tiny_case_plans


class _CountingApi(NoOpApi):
    def __init__(self):
        super().__init__()
        self.calls = {"set": 0, "record": 0, "wait": 0}

    def set(self, *key):
        self.calls["set"] += 1

    def record(self, event, stream):
        self.calls["record"] += 1

    def wait(self, event, stream):
        self.calls["wait"] += 1


class _CountingHandle:
    def __init__(self):
        self.calls = {"put": 0, "wait": 0, "barrier": 0}

    def put_signal(self, peer, channel=0, timeout_ms=0):
        self.calls["put"] += 1

    def wait_signal(self, peer, channel=0, timeout_ms=0):
        self.calls["wait"] += 1

    def barrier(self, channel=0, timeout_ms=0):
        self.calls["barrier"] += 1


def _switches(plan):
    current, count = P.COMPUTE, 0
    for ins in plan.instructions:
        if isinstance(ins, (P.Record, P.WaitEvent, P.Probe)):
            continue
        if ins.stream != current:
            current, count = ins.stream, count + 1
    return count


@pytest.mark.parametrize("world,m,op,setting", [(4, 2048, "AG+GEMM", 0), (4, 2048, "GEMM+RS", 0),
                                                (2, 8192, "GEMM+RS", 0), (4, 8192, "AG+GEMM", 0),
                                                (4, 2048, "GEMM+RS", 2), (2, 2048, "AG+GEMM", 4)])
def test_one_call_per_instruction(world, m, op, setting):
    for plan, region_cols, bufs, b in tiny_case_plans(world, m, op, setting):
        api, handle = _CountingApi(), _CountingHandle()
        regions = {name: CpuRegion(world, plan.rank, plan.shapes[name][0] * cols * 4)
                   for name, cols in region_cols.items()}
        for region in regions.values():
            region.handle = handle
        bound = executor.BoundPlan(plan, regions, torch.float32, region_cols, api=api)
        bound(b, **bufs)
        kinds = [type(i) for i in plan.instructions]
        assert api.calls["record"] == kinds.count(P.Record)
        assert api.calls["wait"] == kinds.count(P.WaitEvent)
        assert api.calls["set"] == _switches(plan) + 1  # + the restore in `finally`
        assert handle.calls == {"put": kinds.count(P.Put), "wait": kinds.count(P.Wait),
                                "barrier": kinds.count(P.Barrier)}
        # Static operands (regions, staging buffer, events, streams) are never sliced per call.
        body = bound.source
        assert "views[" not in body and "getattr" not in body and "isinstance" not in body


def test_staging_buffer_is_owned_by_the_plan():
    (plan, region_cols, bufs, b), *_ = tiny_case_plans(4, 2048, "GEMM+RS")
    bound = bind(plan, region_cols)
    assert bound.tmp is not None and tuple(bound.tmp.shape) == plan.shapes["tmp"]
    assert "tmp[" not in bound.source  # its views are constants, not per-call slices


# The bench cases: instructions and host calls per eager call (max over ranks). A change that
# adds calls to these hot paths must update docs/PERF_NOTES.overlap.md.
BUDGET = {  # (world, M, op): (instructions, host calls)
    (2, 2048, "AG+GEMM"): (13, 24), (2, 2048, "GEMM+RS"): (25, 42),
    (2, 8192, "AG+GEMM"): (10, 20), (2, 8192, "GEMM+RS"): (25, 42),
    (4, 2048, "AG+GEMM"): (20, 32), (4, 2048, "GEMM+RS"): (28, 44),
    (4, 8192, "AG+GEMM"): (21, 36), (4, 8192, "GEMM+RS"): (49, 78),
}


@pytest.mark.parametrize("case", sorted(BUDGET))
def test_bench_cases_within_call_budget(case):
    instructions = calls = 0
    for plan, region_cols, bufs, b in tiny_case_plans(*case):
        bound = bind(plan, region_cols)
        bound(b, **bufs)
        instructions = max(instructions, sum(1 for i in plan.instructions if not isinstance(i, P.Probe)))
        calls = max(calls, bound.host_calls)
    assert (instructions, calls) <= BUDGET[case] and instructions <= BUDGET[case][0], (instructions, calls)
    assert calls <= BUDGET[case][1]


def test_policy_picks_the_measured_setups():
    """The rules of policy.py applied to the bench shapes (K = 8192, N = 28672 / world, 132 SMs)
    give what the first GPU run favoured: one GEMM stream where a shard GEMM has many waves
    (world 2, M = 8192: 13.6 waves), two where its last round is mostly idle (3.4 waves), the
    small world-4 shards (0.85 waves) grouped, the direct reduce-scatter for 512-row chunks (on
    one stream: 0.97 waves leave no tail to fill)."""
    assert not policy.alternate_gemms(4096, 14336)  # W2 M8192 AG
    assert policy.alternate_gemms(1024, 14336) and policy.gather_group(1024, 14336) == 1  # W2 M2048 AG
    assert policy.alternate_gemms(2048, 7168) and policy.gather_group(2048, 7168) == 1  # W4 M8192 AG
    assert policy.gather_group(512, 7168) == 3  # W4 M2048 AG: own shard + one group of 3
    assert policy.rs_algorithm(512, 8192)[0] == "direct" and not policy.alternate_gemms(512, 8192)
    assert policy.gather_group(512, 7168, setting=1) == 1  # OPFUSE_OVERLAP_CHUNKS=1: per shard
    assert policy.alternate_gemms(4096, 14336, setting="on")  # forced (the bench's ours:2s)


def test_grouped_gather_plan_shapes():
    """World 4, 0.85-wave shards: rank 0 and 3 run own + one GEMM of three shards, ranks 1 and 2
    own + two (the rows of a group must be contiguous: no group crosses rank 0)."""
    grid, world = policy.Grid(4, 8), 4
    channels = policy.channel_map(world, grid, None)
    gemms = {}
    for rank in range(world):
        plan = schedules.all_gather_matmul_plan(rank, world, grid, 6, channels, bias=False, group=3)
        gemms[rank] = [(g.a.buf, g.a.row0 // 4, g.a.rows // 4) for g in plan.instructions if isinstance(g, P.Gemm)]
    assert gemms[0] == [("a", 0, 1), ("gather", 1, 3)]
    assert gemms[1] == [("a", 0, 1), ("gather", 2, 2), ("gather", 0, 1)]
    assert gemms[2] == [("a", 0, 1), ("gather", 3, 1), ("gather", 0, 2)]
    assert gemms[3] == [("a", 0, 1), ("gather", 0, 3)]
