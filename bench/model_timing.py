"""Timing helpers of bench/model.py: gpt-fast's decode loop and its per-token time, variants timed
round-robin, the weight bytes one rank streams per decode step."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import block
from timing import round_order

__all__ = ["weight_bytes", "decode_loop", "loop_us", "interleaved_us"]


def weight_bytes(model) -> int:
    """Bytes of the parameters one rank streams per decode step (the embedding table is only
    gathered at the new tokens' rows)."""
    total = 0
    for name, param in model.named_parameters():
        if "tok_embeddings" in name:
            continue
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total


def decode_loop(fn, batch, start, steps, device, sync: bool = False):
    """gpt-fast's loop: ``steps`` tokens per call, the next token the argmax, positions on the device,
    no host sync between tokens (``sync``: the host reads each next token before the next step, as
    Hugging Face's ``generate`` does for its stopping check). Returns a function that runs the loop."""
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    first = torch.tensor([start], dtype=torch.long, device=device)

    def loop():
        tok, pos = token, first
        for _ in range(steps):
            logits = fn(tok, pos)
            tok = logits[:, -1].argmax(-1, keepdim=True)
            pos = pos + 1
            if sync:
                tok.max().item()
        return tok

    return loop


def loop_us(loop, steps, reps, device):
    """Per-token time of ``loop`` (``steps`` tokens), median of ``reps``."""
    loop()
    times = []
    for _ in range(reps):
        dist.barrier()
        block.sync()
        if device != "cuda":
            t0 = time.perf_counter()
            loop()
            times.append((time.perf_counter() - t0) * 1e6 / steps)
            continue
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        loop()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1000.0 / steps)
    return statistics.median(times)


def interleaved_us(fns: dict, calls: int, reps: int, device: str, host: dict | None = None,
                   clocks=None) -> dict:
    """Per-call time of each function, median of ``reps`` rounds; each round times ``calls``
    back-to-back calls of every function in turn (clock and power drift hit every variant alike),
    the order rotated every round so that no variant always follows the same one
    (``timing.round_order``).
    On a GPU each round issues one more call first and starts timing behind it (a CUDA event
    queued after it), so the rounds measure the steady state of steps run back to back, as a
    training loop runs them: not the start from an idle GPU after the barrier, whose host
    issue and rank skew land on the first step (with 3 calls a round, a third of it per step).
    ``host``: filled with each function's host time to issue one call (median; on a GPU, a value
    close to the per-call time means the host, not the GPU, sets the pace).
    ``clocks``: a started ``gpu_clocks.Sampler`` that is told when each function's timed calls ran
    (from the issue of the first, warm-up call included, to the end's completion)."""
    for fn in fns.values():
        fn()
    times: dict = {name: [] for name in fns}
    issued: dict = {name: [] for name in fns}
    for rep in range(reps):
        for name in round_order(fns, rep):
            fn = fns[name]
            dist.barrier()
            block.sync()
            if device != "cuda":
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[name].append((time.perf_counter() - t0) * 1e6 / calls)
                continue
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            started = time.perf_counter()
            fn()
            begin.record()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            issued[name].append((time.perf_counter() - t0) * 1e6 / calls)
            end.record()
            end.synchronize()
            times[name].append(begin.elapsed_time(end) * 1000.0 / calls)
            if clocks is not None:
                clocks.span(name, started, time.perf_counter())
    if host is not None:
        host.update({name: statistics.median(values) for name, values in issued.items() if values})
    return {name: statistics.median(values) for name, values in times.items()}
