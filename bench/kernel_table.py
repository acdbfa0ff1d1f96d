"""Where a step's GPU time goes: device time per kernel category per step, from torch.profiler.

``profile_step(fn, steps)`` runs ``fn`` ``steps`` times under the profiler (after the caller's
warm-up) and returns ``{"categories": {category: us per step}, "top": [(kernel, us per step,
calls per step)], "busy_us": .., "wall_us": ..}``: the time each category's kernels ran (summed
over streams, so overlapped communication counts in full), the ten most expensive kernels (with min / median / max time per call), the
union of all kernel intervals (how long the GPU did anything) and the wall time between the first
kernel's start and the last one's end. ``wall - busy`` is time the GPU sat idle (host-bound
launches, waits on other ranks); ``sum(categories) - busy`` is time that overlapped.

``format_tables(profiles)`` renders ``{variant: profile}`` as one markdown table of categories
(one column per variant) and a top-kernels list per variant.
"""

from __future__ import annotations

import re

import torch

__all__ = ["CATEGORIES", "category_of", "profile_step", "format_tables"]

#: ``(category, pattern)`` in the order tried: the first pattern found in a kernel's name wins.
CATEGORIES = (
    ("opfuse all-reduce+norm", re.compile(r"oneshot_kernel|twoshot_kernel|lamport_kernel|fill_sentinel")),
    ("opfuse norm", re.compile(r"add_norm_kernel|rms_backward_kernel|layer_backward|sum_partials")),
    ("nccl", re.compile(r"nccl", re.I)),
    ("symm_mem / p2p copy", re.compile(r"symm|two_shot|one_shot|multimem|Memcpy PtoP|memcpy.*peer", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn.*(sdpa|mha)", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|Kernel2|sm90_|sm80_|wgmma|matmul", re.I)),
    ("triton (inductor)", re.compile(r"^triton_|triton", re.I)),
    ("torch elementwise / reduce", re.compile(r"elementwise|reduce_kernel|vectorized|unrolled|index|cat|gather|"
                                              r"scatter|fill|copy", re.I)),
    ("memcpy / memset", re.compile(r"memcpy|memset", re.I)),
)


def category_of(name: str) -> str:
    for category, pattern in CATEGORIES:
        if pattern.search(name):
            return category
    return "other"


def _union_us(intervals) -> float:
    total, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def profile_step(fn, steps: int = 3) -> dict:
    """Profile ``steps`` calls of ``fn`` (see the module docstring); the caller warms up first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    if torch.distributed.is_initialized():  # else the first collective absorbs the ranks' skew
        torch.distributed.barrier()
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # host events would cost seconds to process
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    categories: dict[str, float] = {}
    kernels: dict[str, list] = {}
    intervals = []
    for event in prof.events():
        # GPU-side annotations (``nccl:all_reduce`` around NCCL's kernel) are not kernels: counting
        # them would count the same time twice.
        if event.device_type != torch.autograd.DeviceType.CUDA or getattr(event, "is_user_annotation", False):
            continue
        if ":" in event.name and not event.name.startswith(("void ", "ncclDevKernel")) and " " not in event.name:
            continue
        start = event.time_range.start
        stop = event.time_range.end
        duration = stop - start
        if duration <= 0:
            continue
        intervals.append((start, stop))
        category = category_of(event.name)
        categories[category] = categories.get(category, 0.0) + duration / steps
        entry = kernels.setdefault(event.name, [0.0, []])
        entry[0] += duration / steps
        entry[1].append(duration)
    top = sorted(((name, us, len(calls) / steps, sorted(calls)) for name, (us, calls) in kernels.items()),
                 key=lambda t: -t[1])[:10]
    top = [(name, us, count, (calls[0], calls[len(calls) // 2], calls[-1])) for name, us, count, calls in top]
    wall = (max(s for _, s in intervals) - min(s for s, _ in intervals)) / steps if intervals else 0.0
    return {"categories": categories, "top": top, "busy_us": _union_us(intervals) / steps, "wall_us": wall}


def format_tables(profiles: dict, title: str) -> str:
    """``{variant: profile_step(...)}`` as markdown (see the module docstring)."""
    variants = list(profiles)
    names = sorted({c for p in profiles.values() for c in p["categories"]},
                   key=lambda c: -max(p["categories"].get(c, 0.0) for p in profiles.values()))
    lines = [f"\n{title}: GPU time per step by kernel category (us; all streams, so overlapped time counts "
             f"in full)", "| category | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{profiles[v]['categories'].get(name, 0.0):.0f}" for v in variants)
                     + " |")
    for key, label in (("busy_us", "GPU busy (union of kernels)"), ("wall_us", "first kernel start to last end")):
        lines.append(f"| {label} | " + " | ".join(f"{profiles[v][key]:.0f}" for v in variants) + " |")
    for variant in variants:
        lines.append(f"\n{title}, {variant}: top kernels (us per step, calls per step, min / median / max us "
                     f"per call)")
        for name, us, calls, (low, mid, high) in profiles[variant]["top"]:
            lines.append(f"  {us:9.1f}  {calls:5.1f}x  {low:7.1f} / {mid:7.1f} / {high:7.1f}  {name[:130]}")
    return "\n".join(lines)
