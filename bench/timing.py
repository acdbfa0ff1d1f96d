"""Timing shared by the benchmarks.

``graphs_replay_us({name: fn}, calls, replays)`` does the same for several variants, capturing
each once and then timing their replays round-robin, so clock and power drift over a run affects
every variant alike (use it to compare variants whose ratio matters).

``graph_replay_us(fn, calls, replays)`` captures one CUDA graph holding ``calls`` back-to-back
calls of ``fn`` (after ``warmup`` eager calls on a side stream, so lazy compilation and workspace
reservation happen outside the capture) and returns the per-call time of each of ``replays``
timed replays, in microseconds. Every replay starts after a process-group barrier, a device
sync and, with NCCL, a one-element all-reduce on the stream that aligns the ranks on the GPU
before the start event; ``reset`` (untimed) runs before the warm-up calls, the capture and each replay, so in-place
baselines can start from the same data every time.

Also shared: the ceilings a benchmark measures at its start to print floors (``device_copy_gbs``,
``peer_egress_gbs``) and the all-reduce + norm bandwidth floor (``allreduce_floor_us``).

``interleaved_us(fns, reps, calls)`` times eager calls with CUDA events, round-robin across the
functions (one batch of ``calls`` of each per rep), and returns each one's median per call:
clock and thermal drift during a run then hit every function alike instead of whichever ran
first. ``warm_up_gpu()`` runs matmuls until the clocks are up.

``host_cpu_us({name: fn}, calls, rounds, sync)``: the process's CPU time per call of each
function (host cost, not wall time), best of ``rounds`` interleaved rounds.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

import torch
import torch.distributed as dist

__all__ = ["round_order", "graph_replay_us", "graphs_replay_us", "max_over_ranks", "median", "device_copy_gbs", "peer_egress_gbs",
           "allreduce_floor_us", "interleaved_us", "warm_up_gpu"]


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


_ALIGN: dict = {}


def _align_ranks_on_device() -> None:
    """An NCCL all-reduce of one element on the current stream: the ranks' streams leave it within
    about a microsecond of each other, where the host barrier before it returns tens of microseconds
    apart. A timed replay started after the barrier alone charged that skew to the rank that
    started first (it waits for the other in its first calls): ~1 us per call in a graph of 40 calls
    of 5 us, the size of the differences measured at 1-64 tokens (session 22)."""
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    device = torch.cuda.current_device()
    if device not in _ALIGN:
        _ALIGN[device] = torch.zeros(1, device="cuda")
    dist.all_reduce(_ALIGN[device])


def _replay_us(graph: torch.cuda.CUDAGraph, calls: int, reset=None) -> float:
    if reset:
        reset()
    if dist.is_initialized():
        dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _align_ranks_on_device()
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


# Ceilings measured in the run, and the floors derived from them ------------------------------------

def device_copy_gbs(nbytes: int = 256 << 20, calls: int = 5, replays: int = 5) -> float:
    """HBM bandwidth of this GPU as a device-to-device copy: (read + write bytes) / time, GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = median(graph_replay_us(lambda: dst.copy_(src), calls, replays))
    return 2 * nbytes / us / 1e3


def peer_egress_gbs(shard_bytes: int = 32 << 20, calls: int = 5, replays: int = 5, group=None) -> dict:
    """One rank's NVLink egress when every rank sends ``shard_bytes`` to every peer at once (the
    all-gather pattern), GB/s, slowest rank: ``{"nccl": ..., "copy_engine": ..., "best": ...}``.

    ``nccl``: ``all_gather_into_tensor`` (SM-driven); ``copy_engine``: ``copy_`` into each peer's
    torch symmetric memory, one stream per peer (None where symmetric memory is unavailable).
    Egress = (world - 1) * shard / time.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shard = torch.empty(shard_bytes, dtype=torch.uint8, device="cuda").random_()
    gathered = torch.empty(world * shard_bytes, dtype=torch.uint8, device="cuda")
    moved = (world - 1) * shard_bytes
    out = {"nccl": moved / max_over_ranks(median(graph_replay_us(
        lambda: dist.all_gather_into_tensor(gathered, shard, group=group), calls, replays))) / 1e3}
    out["copy_engine"] = None
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        buffer = symm_mem.empty(world * shard_bytes, dtype=torch.uint8, device="cuda")
        handle = symm_mem.rendezvous(buffer, (group or dist.group.WORLD).group_name)
        offset = buffer.data_ptr() - handle.buffer_ptrs[rank]  # the tensor may sit inside a larger allocation
        peers = [p for p in range(world) if p != rank]
        slots = [handle.get_buffer(p, (shard_bytes,), torch.uint8, offset + rank * shard_bytes) for p in peers]
        streams = [torch.cuda.Stream() for _ in peers]

        def push():
            main = torch.cuda.current_stream()
            for stream, slot in zip(streams, slots):
                stream.wait_stream(main)
                with torch.cuda.stream(stream):
                    slot.copy_(shard)
            for stream in streams:
                main.wait_stream(stream)

        out["copy_engine"] = moved / max_over_ranks(median(graph_replay_us(push, calls, replays))) / 1e3
        torch.cuda.synchronize()
        dist.barrier(group=group)
    except Exception:  # noqa: BLE001 - no symmetric memory here: NCCL's number stands alone
        pass
    out["best"] = max(v for v in (out["nccl"], out["copy_engine"]) if v is not None)
    return out


def allreduce_floor_us(message_bytes: int, world: int, peer_gbs: float, hbm_gbs: float) -> tuple[float, str]:
    """Bandwidth floor of an all-reduce + residual add + norm of ``message_bytes`` per rank, us,
    and which resource sets it (``"nvlink"`` or ``"hbm"``).

    NVLink: without multicast every rank must send 2 (W - 1) / W of the message (each rank owns
    1/W of the sums, and receives the other ranks' parts of it, then sends its sums to them),
    over ``peer_gbs`` of egress. HBM: read the partial sums and the residual, write the output
    and the new residual, 4 messages over ``hbm_gbs`` (read + write). The two overlap at best,
    so the floor is the larger. Latency (launch, flag hops: ~2-3 us) is not in it: at a few
    tokens the floor is near 0 and the ratio to it means nothing.
    """
    if world < 2:
        nvlink = 0.0
    else:
        nvlink = 2 * (world - 1) / world * message_bytes / peer_gbs / 1e3
    hbm = 4 * message_bytes / hbm_gbs / 1e3
    return (nvlink, "nvlink") if nvlink >= hbm else (hbm, "hbm")


def round_order(names, round_index: int) -> list:
    """``names`` rotated by ``round_index``: the order of one round of round-robin timing.

    A fixed order can bias a comparison: the variant timed right after a light one (an eager model
    the host holds back, an idle GPU behind a barrier) may start with power and clock headroom
    that the ones behind it do not get (docs/PERF_NOTES.model.md, session 9). Rotating gives
    every variant every position over ``len(names)`` rounds."""
    names = list(names)
    shift = round_index % len(names) if names else 0
    return names[shift:] + names[:shift]


def interleaved_us(fns: Mapping[str, Callable[[int], object]], reps: int, calls: int,
                   warmup: int = 2) -> dict[str, float]:
    """Median microseconds per call of every ``fns[name](i)`` (``i`` = call index, for rotating
    inputs), timed round-robin: each rep times one batch of ``calls`` calls of every function,
    in an order rotated every rep (:func:`round_order`)."""
    for fn in fns.values():
        for i in range(warmup):
            fn(i)
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(reps):
        for name in round_order(fns, rep):
            fn = fns[name]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(calls):
                fn(i)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / calls)
    return {name: median(values) for name, values in times.items()}


def host_cpu_us(variants: Mapping[str, Callable[[], object]], calls: int, rounds: int,
                sync: Callable[[], object] = lambda: None) -> dict[str, float]:
    """Best CPU time per call (us) of each ``{label: fn}``, rounds interleaved, one warm call before each."""
    best = {label: float("inf") for label in variants}
    for _ in range(rounds):
        for label, fn in variants.items():
            fn()  # warm
            sync()
            start = time.process_time()
            for _ in range(calls):
                fn()
            sync()
            best[label] = min(best[label], (time.process_time() - start) * 1e6 / calls)
    return best


def warm_up_gpu(seconds: float = 0.5) -> None:
    """Run bf16 matmuls for ``seconds`` so the first measurement does not pay for clock ramp-up."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    begin = time.perf_counter()
    while time.perf_counter() - begin < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
