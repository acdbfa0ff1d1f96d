"""CUDA-graph timing shared by the benchmarks.

``graph_replay_us(fn, calls, replays)`` captures one CUDA graph holding ``calls`` back-to-back
calls of ``fn`` (after ``warmup`` eager calls on a side stream, so lazy compilation and workspace
reservation happen outside the capture) and returns the per-call time of each of ``replays``
timed replays, in microseconds. Every replay starts after a process-group barrier and a device
sync; ``reset`` (untimed) runs before the warm-up calls, the capture and each replay, so in-place
baselines can start from the same data every time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["graph_replay_us", "max_over_ranks", "median"]


def max_over_ranks(value: float) -> float:
    """The largest ``value`` over the ranks of the default group (the slowest rank's time)."""
    t = torch.tensor([value], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def median(values):
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def graph_replay_us(fn, calls: int, replays: int, warmup: int = 3, reset=None) -> list[float]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            if reset:
                reset()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    graph = torch.cuda.CUDAGraph()
    if reset:
        reset()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()  # untimed: first replay after capture
    times = []
    for _ in range(replays):
        if reset:
            reset()
        if dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return times
