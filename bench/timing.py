"""CUDA-graph timing shared by the benchmarks.

``graphs_replay_us({name: fn}, calls, replays)`` does the same for several variants, capturing
each once and then timing their replays round-robin, so clock and power drift over a run affects
every variant alike (use it to compare variants whose ratio matters).

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

__all__ = ["graph_replay_us", "graphs_replay_us", "max_over_ranks", "median"]


def max_over_ranks(value: float) -> float:
    """The largest ``value`` over the ranks of the default group (the slowest rank's time)."""
    t = torch.tensor([value], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def median(values):
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _capture(fn, calls: int, warmup: int, reset=None) -> torch.cuda.CUDAGraph:
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
    return graph


def _replay_us(graph: torch.cuda.CUDAGraph, calls: int, reset=None) -> float:
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
    return start.elapsed_time(end) * 1000.0 / calls


def graph_replay_us(fn, calls: int, replays: int, warmup: int = 3, reset=None) -> list[float]:
    graph = _capture(fn, calls, warmup, reset)
    times = [_replay_us(graph, calls, reset) for _ in range(replays)]
    del graph
    return times


def graphs_replay_us(fns: dict, calls: int, replays: int, warmup: int = 3) -> dict[str, list[float]]:
    """``{name: per-call times of each replay}`` for every variant in ``fns``, replayed in turn."""
    graphs = {name: _capture(fn, calls, warmup) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(replays):
        for name, graph in graphs.items():
            times[name].append(_replay_us(graph, calls))
    del graphs
    return times
