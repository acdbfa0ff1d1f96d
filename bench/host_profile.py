"""Where a step's host time goes: one or more calls of a step function under cProfile, the functions
with the most time of their own, per step (bench/model.py ``--profile``).

A training step whose host time exceeds its GPU time leaves the GPU idle (issue 27: FP8 steps were
host-bound); the kernel table cannot show that, this table does. cProfile roughly doubles the
Python time it observes: compare rows with each other, not with the timed step. Seen on the GPU
hosts (torch 2.11): the body of a ``torch.library`` custom op shows up as the own time
of ``torch/_library/custom_ops.py(backend_impl)`` while the functions it calls are listed too, so
that row counts the custom ops' bodies, and the rows below it overlap with it.

Environment: ``OPFUSE_HOST_PROFILE_TOP`` rows (default 18); ``OPFUSE_HOST_PROFILE_DUMP``
a path for the raw pstats file (callers and callees: ``python -m pstats FILE``);
``OPFUSE_HOST_PROFILE_OPS=1`` also prints torch.profiler's operator table by self CPU time over the
same number of steps, which charges each custom op's Python body to that op (the view to trust where
cProfile's custom-op rows do not add up).
"""

from __future__ import annotations

import cProfile
import os
import pstats

import torch

__all__ = ["host_profile"]


def _where(key) -> str:
    filename, line, name = key
    if filename == "~":  # a built-in: its name says enough
        return name
    parts = filename.replace(os.sep, "/").split("/")
    for anchor in ("opfuse", "torch", "triton", "bench", "examples"):
        if anchor in parts:
            parts = parts[len(parts) - 1 - parts[::-1].index(anchor):]
            break
    return f"{'/'.join(parts[-3:])}:{line}({name})"


def host_profile(fn, steps: int = 2, top: int | None = None) -> list[str]:
    """The ``top`` functions (default ``OPFUSE_HOST_PROFILE_TOP``, else 18) by own time over ``steps``
    calls of ``fn`` (already warm): lines of ``own us/step, cumulative us/step, calls/step,
    function``, the first line the total."""
    if top is None:
        top = int(os.environ.get("OPFUSE_HOST_PROFILE_TOP", "18"))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profiler = cProfile.Profile()
    # cProfile sees the thread that enabled it: the backward runs there too, not on the autograd
    # engine's device thread.
    with torch.autograd.set_multithreading_enabled(False):
        profiler.enable()
        for _ in range(steps):
            fn()
        profiler.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if os.environ.get("OPFUSE_HOST_PROFILE_OPS"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with torch.autograd.set_multithreading_enabled(False):
                for _ in range(steps):
                    fn()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    dump = os.environ.get("OPFUSE_HOST_PROFILE_DUMP")
    if dump:  # the raw pstats file, for callers / callees (python -m pstats FILE)
        profiler.dump_stats(dump)
    stats = pstats.Stats(profiler).stats  # key -> (primitive calls, calls, own s, cumulative s, callers)
    total = sum(entry[2] for entry in stats.values())
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    lines = [f"total own time {total / steps * 1e6:.0f} us/step under cProfile"]
    for key, (_, calls, own, cumulative, _) in rows:
        lines.append(f"{own / steps * 1e6:9.0f} {cumulative / steps * 1e6:9.0f} {calls / steps:7.1f}  {_where(key)}")
    return lines
