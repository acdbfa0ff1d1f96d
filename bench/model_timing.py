"""Timing helpers of bench/model.py: gpt-fast's decode loop and its per-token time, variants timed
round-robin, the weight bytes one rank streams per decode step."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import block

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


def decode_loop(fn, batch, start, steps, device):
    """gpt-fast's loop: ``steps`` tokens per call, the next token the argmax, positions on the device,
    no host sync between tokens. Returns a function that runs the loop."""
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    first = torch.tensor([start], dtype=torch.long, device=device)

    def loop():
        tok, pos = token, first
        for _ in range(steps):
            logits = fn(tok, pos)
            tok = logits[:, -1].argmax(-1, keepdim=True)
            pos = pos + 1
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


def interleaved_us(fns: dict, calls: int, reps: int, device: str) -> dict:
    """Per-call time of each function, median of ``reps`` rounds; each round times ``calls``
    back-to-back calls of every function in turn (clock and power drift hit every variant alike)."""
    for fn in fns.values():
        fn()
    times: dict = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            dist.barrier()
            block.sync()
            if device != "cuda":
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[name].append((time.perf_counter() - t0) * 1e6 / calls)
                continue
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times[name].append(begin.elapsed_time(end) * 1000.0 / calls)
    return {name: statistics.median(values) for name, values in times.items()}
