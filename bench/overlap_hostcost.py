"""Host (Python) cost of an eager overlap call, measured on CPU without a GPU.

    PYTHONPATH=. python3 bench/overlap_hostcost.py [--iters N] [--json FILE] [--plot FILE.png]

For each case of ``bench/overlap.py`` (world, M, op, ``OPFUSE_OVERLAP_CHUNKS``) this builds the
plans the policy picks for the real sizes (same algorithm, sub-chunk grid, GEMM grouping and
stream alternation), binds them to tiny CPU tensors with no-op stream/event/signal primitives,
and times a call of the compiled plan. What it measures is the Python + torch-dispatcher part of
the host time, i.e. what the executor controls; a GPU host adds each call's CUDA launch cost
(~2-5 us per kernel / copy / event in the driver), which no Python change removes.

Columns: ``instructions`` of the plan (as issued: GEMMs, copies, signals, events),
``host calls`` (every call into torch the compiled function makes, stream switches and per-call
views included), ``us/call`` (median over ranks' plans of the per-call time, this CPU).
:func:`measure_impl` also times the whole forward function (context and plan lookup, output
allocation, the compiled plan) on tiny shapes: the difference is the fixed per-call cost.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (bench/common.py)
from opfuse.families.collective_linear.overlap import executor, resources  # noqa: E402
from opfuse.families.collective_linear import p2p as impl  # noqa: E402
from opfuse.families.collective_linear.overlap.cpu_binding import CpuPool, NoOpApi, bind, tiny_case_plans  # noqa: E402
from opfuse.families.collective_linear.overlap.plan import Probe  # noqa: E402

#: (world, tokens M, op) of bench/overlap.py; K = 8192, N = 28672 / world.
CASES = [(w, m, op) for w in (2, 4) for m in (2048, 8192) for op in ("AG+GEMM", "GEMM+RS")]


def measure(world: int, m: int, op: str, setting: int = 0, iters: int = 2000) -> dict:
    """``{"instructions", "host_calls", "us_per_call"}`` (max instructions / calls over ranks,
    median per-call time over ranks)."""
    times, instructions, calls = [], 0, 0
    for plan, region_cols, bufs, b in tiny_case_plans(world, m, op, setting):
        bound = bind(plan, region_cols)
        instructions = max(instructions, sum(1 for i in plan.instructions if not isinstance(i, Probe)))
        calls = max(calls, bound.host_calls)
        for _ in range(min(200, iters)):
            bound.call(b, **bufs)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(iters):
                bound.call(b, **bufs)
            best = min(best, (time.perf_counter() - start) / iters)
        times.append(best * 1e6)
    times.sort()
    return {"instructions": instructions, "host_calls": calls, "us_per_call": times[len(times) // 2]}


@contextlib.contextmanager
def _fake_backend(ctx):
    saved = (impl._context, executor.cuda_api, resources.signal_pad_bytes)
    api = NoOpApi()
    impl._context, executor.cuda_api = (lambda group, t: ctx), (lambda device: api)
    resources.signal_pad_bytes = lambda: 2048
    try:
        yield
    finally:
        impl._context, executor.cuda_api, resources.signal_pad_bytes = saved


def measure_impl(world: int, op: str, iters: int = 2000, rows: int = 4, k: int = 8, n: int = 8) -> dict:
    """Per-call time of the forward function of ``op`` (rank 0's plan; the peers are not run:
    the signals are no-ops) on tiny CPU tensors, and of its compiled plan alone with a fresh
    output per call (as the forward allocates one): the difference is the forward's own cost."""
    ctx = resources.Context(None, CpuPool(world, 0), 0, world)
    with _fake_backend(ctx):
        if op == "AG+GEMM":
            x, w = torch.randn(rows, k), torch.randn(n, k)

            def call():
                return impl.all_gather_linear_forward(x, w, None, group="g")
        else:
            x, w = torch.randn(world * rows, k), torch.randn(n, k)

            def call():
                return impl.linear_reduce_scatter_forward(x, w, None, bias_after=True, group="g")
        shape = tuple(call().shape)
        (bound,) = ctx.plans.values()
        wt = w.t()
        total, plan_only = float("inf"), float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(iters):
                call()
            total = min(total, (time.perf_counter() - start) / iters)
            start = time.perf_counter()
            for _ in range(iters):
                bound.call(wt, a=x, out=x.new_empty(shape))
            plan_only = min(plan_only, (time.perf_counter() - start) / iters)
    return {"us_per_call": total * 1e6, "plan_us": plan_only * 1e6, "host_calls": bound.host_calls}


def main() -> int:
    parser = common.parser("overlap_hostcost", __doc__)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--chunks", type=int, nargs="*", default=[0, 1, 2, 4])
    args = parser.parse_args()

    def run_all():
        torch.set_num_threads(1)
        plans, calls = [], []
        for world, m, op in CASES:
            for setting in args.chunks:
                plans.append(dict(world=world, M=m, op=op, chunks=setting, **measure(world, m, op, setting, args.iters)))
            common.progress(f"world {world} M={m} {op} done")
        for world in (2, 4):
            for op in ("AG+GEMM", "GEMM+RS"):
                calls.append(dict(world=world, op=op, **measure_impl(world, op, args.iters)))
        return {"plans": plans, "calls": calls}

    data = common.results(args, "overlap_hostcost", 0, run_all)
    print("| world | M | op | chunks | instructions | host calls | us/call (CPU, no launches) |")
    print("|---|---|---|---|---|---|---|")
    for r in data["plans"]:
        print(f"| {r['world']} | {r['M']} | {r['op']} | {r['chunks'] or 'auto'} | {r['instructions']} | "
              f"{r['host_calls']} | {r['us_per_call']:.1f} |")
    print("\nWhole forward call (tiny shapes, rank 0): | world | op | us/call | plan + output allocation |")
    for r in data["calls"]:
        print(f"| {r['world']} | {r['op']} | {r['us_per_call']:.1f} | {r['plan_us']:.1f} |")
    series = {}
    for r in data["plans"]:
        label = f"world {r['world']} {r['op']} chunks={r['chunks'] or 'auto'}"
        series.setdefault(label, []).append((r["M"], r["us_per_call"]))
    common.finish(args, data, series=series, xlabel="M (tokens over all ranks)", ylabel="host us per call (CPU)",
                  title="eager overlap call: Python + dispatcher time per call (no GPU)", baseline=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
