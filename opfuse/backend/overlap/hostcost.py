"""Host (Python) cost of an eager overlap call, measured on CPU without a GPU.

    PYTHONPATH=. python -m opfuse.backend.overlap.hostcost [--iters N]

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

import argparse
import contextlib
import time

import torch

from . import executor, impl, policy, resources, schedules
from .executor import BoundPlan
from .plan import Probe

__all__ = ["CASES", "case_plans", "measure", "measure_impl", "main"]

#: (world, tokens M, op) of bench/overlap.py; K = 8192, N = 28672 / world.
CASES = [(w, m, op) for w in (2, 4) for m in (2048, 8192) for op in ("AG+GEMM", "GEMM+RS")]
HIDDEN, FFN = 8192, 28672


class _Handle:
    def put_signal(self, peer, channel=0, timeout_ms=0):
        pass

    def wait_signal(self, peer, channel=0, timeout_ms=0):
        pass

    def barrier(self, channel=0, timeout_ms=0):
        pass


class _Region:
    """A CPU stand-in for a symmetric region: one tensor per rank."""

    def __init__(self, world: int, rank: int, nbytes: int):
        self.rank, self.nbytes, self.handle = rank, nbytes, _Handle()
        self.storages = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(world)]

    def peer_tensor(self, rank, dtype, shape):
        count = 1
        for s in shape:
            count *= s
        return self.storages[rank][:count * torch.empty((), dtype=dtype).element_size()].view(dtype).view(shape)

    def local_tensor(self, dtype=torch.uint8):
        return self.storages[self.rank].view(dtype)


class _Api:
    def __init__(self):
        self.streams: dict = {}
        self.side = tuple((object(), (i + 1, 0, 1)) for i in range(3))

    def current(self):
        return (0, 0, 1)

    def stream(self, key):
        self.streams[key] = object()
        return self.streams[key]

    def set(self, *key):
        pass

    def record(self, event, stream):
        pass

    def wait(self, event, stream):
        pass

    def new_event(self):
        return object()


def case_plans(world: int, m: int, op: str, setting: int = 0, *, sms: int = policy.DEFAULT_SMS):
    """Per-rank ``(plan, region_cols, call_buffers)`` with the policy's decisions for the real
    sizes and tiny tensors of the same structure."""
    rows = m // world
    out = []
    if op == "AG+GEMM":
        n = FFN // world
        grid = policy.gather_grid(rows, HIDDEN, setting)
        alternate, group = policy.alternate_gemms(rows, n, sms), policy.gather_group(rows, n, setting, sms)
        tiny = policy.Grid(2 * grid.row_parts, 8, grid.row_parts, 1)
        channels = policy.channel_map(world, tiny, None)
        for rank in range(world):
            plan = schedules.all_gather_matmul_plan(rank, world, tiny, 8, channels, bias=False, alternate=alternate,
                                                    group=group)
            bufs = {"a": torch.randn(tiny.rows, 8), "out": torch.empty(world * tiny.rows, 8)}
            out.append((plan, {"gather": 8}, bufs, torch.randn(8, 8)))
        return out
    algorithm, grid = policy.rs_algorithm(rows, HIDDEN, setting)
    if algorithm == "direct":
        alternate = policy.alternate_gemms(rows, HIDDEN, sms)
        channels = policy.channel_map(world, None, None, direct=True)
        for rank in range(world):
            plan = schedules.matmul_reduce_scatter_direct_plan(rank, world, 2, 8, channels, alternate=alternate)
            bufs = {"a": torch.randn(world * 2, 8), "out": torch.empty(2, 8)}
            out.append((plan, {"direct": 8}, bufs, torch.randn(8, 8)))
        return out
    tiny = policy.Grid(2 * grid.row_parts, 2 * grid.col_parts, grid.row_parts, grid.col_parts)
    channels = policy.channel_map(world, None, tiny)
    for rank in range(world):
        plan = schedules.matmul_reduce_scatter_plan(rank, world, tiny, channels)
        bufs = {"a": torch.randn(world * tiny.rows, 8), "out": torch.empty(tiny.rows, tiny.cols)}
        out.append((plan, {"ring": tiny.sub_cols}, bufs, torch.randn(8, tiny.cols)))
    return out


def _bind(plan, region_cols):
    regions = {}
    for name, cols in region_cols.items():
        regions[name] = _Region(plan.world, plan.rank, plan.shapes[name][0] * cols * 4)
    return BoundPlan(plan, regions, torch.float32, region_cols, api=_Api())


def measure(world: int, m: int, op: str, setting: int = 0, iters: int = 2000) -> dict:
    """``{"instructions", "host_calls", "us_per_call"}`` (max instructions / calls over ranks,
    median per-call time over ranks)."""
    times, instructions, calls = [], 0, 0
    for plan, region_cols, bufs, b in case_plans(world, m, op, setting):
        bound = _bind(plan, region_cols)
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


class _Pool:
    def __init__(self, world: int, rank: int):
        self.world, self.rank, self.regions = world, rank, {}

    def reserve(self, name, nbytes):
        if name not in self.regions:
            self.regions[name] = _Region(self.world, self.rank, nbytes)
        return self.regions[name]


@contextlib.contextmanager
def _fake_backend(ctx):
    saved = (impl._context, executor.cuda_api, resources.signal_pad_bytes)
    api = _Api()
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
    ctx = resources.Context(None, _Pool(world, 0), 0, world)
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--chunks", type=int, nargs="*", default=[0, 1, 2, 4])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| world | M | op | chunks | instructions | host calls | us/call (CPU, no launches) |")
    print("|---|---|---|---|---|---|---|")
    for world, m, op in CASES:
        for setting in args.chunks:
            r = measure(world, m, op, setting, args.iters)
            print(f"| {world} | {m} | {op} | {setting or 'auto'} | {r['instructions']} | {r['host_calls']} | "
                  f"{r['us_per_call']:.1f} |")
    print("\nWhole forward call (tiny shapes, rank 0): | world | op | us/call | plan + output allocation |")
    for world in (2, 4):
        for op in ("AG+GEMM", "GEMM+RS"):
            r = measure_impl(world, op, args.iters)
            print(f"| {world} | {op} | {r['us_per_call']:.1f} | {r['plan_us']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
