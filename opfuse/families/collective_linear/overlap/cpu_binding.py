"""Plans bound on a CPU: stand-ins for the CUDA primitives a :class:`~.executor.BoundPlan` calls
(streams, events, signals, symmetric regions), through the executor's ``api`` seam.

The tests use them to check what a compiled plan issues (one call per instruction, stream
switches only where needed) and ``bench/overlap_hostcost.py`` to time the Python part of an
eager call, both without a GPU. :func:`tiny_case_plans` builds plans with the policy's decisions
for real sizes (algorithm, grids, grouping, streams) over tiny tensors of the same structure.
"""

from __future__ import annotations

import torch

from . import policy, schedules
from .executor import BoundPlan

__all__ = ["NoOpHandle", "CpuRegion", "NoOpApi", "CpuPool", "bind", "tiny_case_plans", "HIDDEN", "FFN"]

#: The bench's layer sizes (bench/overlap.py): K = HIDDEN, N = FFN / world.
HIDDEN, FFN = 8192, 28672


class NoOpHandle:
    """Signals that do nothing (one rank's plan runs alone)."""

    def put_signal(self, peer, channel=0, timeout_ms=0):
        pass

    def wait_signal(self, peer, channel=0, timeout_ms=0):
        pass

    def barrier(self, channel=0, timeout_ms=0):
        pass


class CpuRegion:
    """A CPU stand-in for a symmetric region: one tensor per rank."""

    def __init__(self, world: int, rank: int, nbytes: int, handle=None):
        self.rank, self.nbytes = rank, nbytes
        self.handle = handle if handle is not None else NoOpHandle()
        self.storages = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(world)]

    def peer_tensor(self, rank, dtype, shape):
        count = 1
        for s in shape:
            count *= s
        return self.storages[rank][:count * torch.empty((), dtype=dtype).element_size()].view(dtype).view(shape)

    def local_tensor(self, dtype=torch.uint8):
        return self.storages[self.rank].view(dtype)


class NoOpApi:
    """Stream and event primitives that do nothing."""

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


class CpuPool:
    """A pool whose regions are :class:`CpuRegion`\\ s (never full)."""

    def __init__(self, world: int, rank: int):
        self.world, self.rank, self.regions = world, rank, {}

    def reserve(self, name, nbytes):
        if name not in self.regions:
            self.regions[name] = CpuRegion(self.world, self.rank, nbytes)
        return self.regions[name]


def bind(plan, region_cols: dict, api=None, handle=None) -> BoundPlan:
    """``plan`` bound to fresh float32 :class:`CpuRegion`\\ s and no-op (or the given) primitives."""
    regions = {name: CpuRegion(plan.world, plan.rank, plan.shapes[name][0] * cols * 4, handle)
               for name, cols in region_cols.items()}
    return BoundPlan(plan, regions, torch.float32, region_cols, api=api or NoOpApi())


def tiny_case_plans(world: int, m: int, op: str, setting: int = 0, *, sms: int = policy.DEFAULT_SMS):
    """Per-rank ``(plan, region_cols, call_buffers, b)`` for the bench case ``(world, M, op)``
    (``op`` is ``"AG+GEMM"`` or ``"GEMM+RS"``), with the policy's decisions for the real sizes
    and tiny tensors of the same structure."""
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
