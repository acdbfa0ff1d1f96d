"""Where a training step's idle GPU time comes from: a host + device timeline of back-to-back steps
in the steady state, from torch.profiler.

``kernel_table`` says how long kernels ran; this says why the GPU sat idle between them. A few
steps run back to back under the profiler with host events (as the timing loop runs them: no
sync between steps); the analysis covers the steps after the first. Every gap of the GPU's
activity (the union of all streams' kernels, copies and memsets) is classified by when the work
after it was handed to the driver:

* ``host``: the launch call of the kernel after the gap began after the gap did: the GPU had run
  out of work and waited for the host (Python, the dispatcher, a custom op's host code, a sync);
* ``wait``: that kernel was launched before the gap began: it waited for something else (an event
  of another stream, a peer rank's data).

``step_timeline(fn)`` returns ``{"host_us", "gpu_wall_us", "busy_us", "idle": {class: us}, ...}``
per step, ``"gaps"``: the ``top`` longest gaps, each with the kernels around it and, for
``host`` gaps, the innermost host op running when the GPU ran dry and the one that made the late
launch, and ``"collectives"``: each NCCL kernel of the last step with the time other streams'
kernels ran beside it (a collective left to NCCL that nothing runs beside is not overlapped,
whatever the graph's order says). ``format_timeline(found, title)`` renders ``{variant: step_timeline(...)}`` as markdown.
"""

from __future__ import annotations

import torch

__all__ = ["step_timeline", "format_timeline"]

_DEVICE_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _activity(event) -> str:
    """``kernel`` (any device activity), ``cuda_runtime`` (a CUDA runtime/driver call) or ``cpu_op``.
    ``activity_type()`` is newer than torch 2.11; the device type and the name say the same."""
    if hasattr(event, "activity_type"):
        return str(event.activity_type()).rsplit(".", 1)[-1].lower()
    name = event.name()
    if event.device_type() != torch.autograd.DeviceType.CPU:
        if getattr(event, "is_user_annotation", lambda: False)() or (":" in name and " " not in name
                                                                       and not name.startswith("ncclDevKernel")):
            return "gpu_user_annotation"  # e.g. ``nccl:all_reduce`` around NCCL's kernel: not a kernel
        return "kernel"
    if name.startswith(("cuda", "cu")) and event.correlation_id():
        return "cuda_runtime"
    return "cpu_op"


def _end_ns(event) -> int:
    return event.end_ns() if hasattr(event, "end_ns") else event.start_ns() + event.duration_ns()


def _host_op_at(ops, t_ns: int) -> str:
    """The innermost host op (aten, Python custom op, Inductor's graph call) running at ``t_ns``."""
    best = None
    for start, end, name in ops:
        if start <= t_ns <= end and (best is None or end - start < best[1] - best[0]):
            best = (start, end, name)
    return best[2] if best else "-"


def step_timeline(fn, steps: int = 4, min_gap_us: float = 10.0, top: int = 12) -> dict:
    """Profile ``steps`` back-to-back calls of ``fn`` with host events and analyse the steady state:
    the calls after the first (whose start waits for nothing), from the first kernel they launch
    to the last kernel's end; per-step values are over those ``steps - 1`` calls (see the module
    docstring)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    steps = max(2, steps)
    torch.cuda.synchronize()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for index in range(steps):
            with record_function(f"timeline_step_{index}"):
                fn()
        torch.cuda.synchronize()
    device, launches, ops, marks = [], {}, [], {}
    for event in prof.profiler.kineto_results.events():
        kind = _activity(event)
        if kind in _DEVICE_ACTIVITIES and event.duration_ns() > 0:
            device.append(event)
        elif kind in ("cuda_runtime", "cuda_driver"):
            launches[event.correlation_id()] = event
        elif kind in ("cpu_op", "user_annotation", "python_function"):
            if event.name().startswith("timeline_step_"):
                marks[int(event.name().rsplit("_", 1)[1])] = (event.start_ns(), _end_ns(event))
            else:
                ops.append((event.start_ns(), _end_ns(event), event.name()))
    measured = steps - 1
    host_us = sum(marks[i][1] - marks[i][0] for i in range(1, steps) if i in marks) / 1e3 / measured

    def launch_of(event):
        linked = getattr(event, "linked_correlation_id", lambda: 0)()
        return launches.get(linked) or launches.get(event.correlation_id())

    # The window: from the first kernel launched by the second call on.
    second = marks.get(1, (0, 0))[0]
    later = [e for e in device if (launch_of(e) is not None and launch_of(e).start_ns() >= second)]
    if not later:
        return {"host_us": host_us, "gpu_wall_us": 0.0, "busy_us": 0.0, "idle": {}, "gaps": [], "steps": measured}
    window_start = min(e.start_ns() for e in later)
    device = sorted((e for e in device if _end_ns(e) > window_start), key=lambda e: max(e.start_ns(), window_start))
    idle = {"host": 0.0, "wait": 0.0}
    gaps = []
    before, reach = device[0], _end_ns(device[0])
    busy_ns = reach - max(device[0].start_ns(), window_start)
    for event in device[1:]:
        start, end = max(event.start_ns(), window_start), _end_ns(event)
        if start > reach:
            gap_us = (start - reach) / 1e3
            launch = launch_of(event)
            kind = "host" if launch is not None and launch.start_ns() > reach else "wait"
            idle[kind] += gap_us
            if gap_us >= min_gap_us:
                gaps.append({"us": gap_us, "class": kind, "before": before.name(), "after": event.name(),
                             "stream_after": getattr(event, "device_resource_id", lambda: None)(),
                             "launch_after_gap_start_us": (launch.start_ns() - reach) / 1e3 if launch else None,
                             "host_op": _host_op_at(ops, launch.start_ns()) if launch else "-",
                             "host_op_at_start": _host_op_at(ops, reach)})
            busy_ns += end - start
        elif end > reach:
            busy_ns += end - reach
        if end > reach:
            reach, before = end, event
    gaps.sort(key=lambda g: -g["us"])
    return {"host_us": host_us, "gpu_wall_us": (reach - window_start) / 1e3 / measured,
            "busy_us": busy_ns / 1e3 / measured, "idle": {k: v / measured for k, v in idle.items()},
            "gaps": gaps[:top], "gap_count": len(gaps), "steps": measured,
            "collectives": _collectives(device, (reach - window_start) // measured)}


def _stream(event):
    return getattr(event, "device_resource_id", lambda: None)()


def _collectives(device, step_ns: int) -> list[dict]:
    """Every NCCL kernel of the last measured step (the step length back from the last kernel's end):
    when it ran (us from that window's start), how long, and how much of that time kernels of other
    streams ran beside it (the overlap a collective left to NCCL is meant to get), with the kernels
    that ran beside it longest and the kernel that ended on another stream just before it started
    (what it likely waited for)."""
    ends = max(_end_ns(e) for e in device)
    last_start = ends - step_ns
    rows = []
    for event in device:
        if not event.name().startswith("nccl") or event.start_ns() < last_start:
            continue
        start, end, stream = event.start_ns(), _end_ns(event), _stream(event)
        beside, before = {}, None
        for other in device:
            if _stream(other) == stream:
                continue
            lo, hi = max(start, other.start_ns()), min(end, _end_ns(other))
            if hi > lo:
                beside[other.name()] = beside.get(other.name(), 0) + hi - lo
            if _end_ns(other) <= start and (before is None or _end_ns(other) > _end_ns(before)):
                before = other
        rows.append({"name": event.name(), "at_us": (start - last_start) / 1e3, "us": (end - start) / 1e3,
                     "beside_us": sum(beside.values()) / 1e3,
                     "beside": sorted(beside.items(), key=lambda kv: -kv[1])[:2],
                     "after": before.name() if before is not None else "-",
                     "after_gap_us": (start - _end_ns(before)) / 1e3 if before is not None else None})
    return sorted(rows, key=lambda r: r["at_us"])


def format_timeline(found: dict, title: str) -> str:
    """``{variant: step_timeline(...)}`` as markdown: a summary row per variant, then its longest gaps."""
    lines = [f"\n{title}: steady-state timeline, us per step (back-to-back steps after the first): host time to "
             f"issue a step, GPU first-to-last kernel, "
             f"busy (union of streams), idle split by cause (host: the next kernel was launched late; "
             f"wait: it was launched but waited on another stream, a peer or an event)",
             "| variant | host issue | GPU wall | busy | idle: host | idle: wait |", "|---|---|---|---|---|---|"]
    for variant, t in found.items():
        lines.append(f"| {variant} | {t['host_us']:.0f} | {t['gpu_wall_us']:.0f} | {t['busy_us']:.0f} | "
                     f"{t['idle'].get('host', 0.0):.0f} | {t['idle'].get('wait', 0.0):.0f} |")
    for variant, t in found.items():
        lines.append(f"\n{title}, {variant}: longest gaps over {t.get('steps', 1)} steps ({t.get('gap_count', 0)} of "
                     f">= 10 us; us, cause, "
                     f"launch - gap start, kernel before -> kernel after [host ops])")
        for g in t["gaps"]:
            late = "-" if g["launch_after_gap_start_us"] is None else f"{g['launch_after_gap_start_us']:+.0f}"
            op = (f" [host was in {g.get('host_op_at_start', '-')[:50]}; launched from {g['host_op'][:50]}]"
                  if g["class"] == "host" else "")
            lines.append(f"  {g['us']:8.1f}  {g['class']:4s}  {late:>7s}  {g['before'][:55]} -> "
                         f"{g['after'][:55]}{op}")
    for variant, t in found.items():
        if not t.get("collectives"):
            continue
        lines.append(f"\n{title}, {variant}: NCCL kernels of the last step (us from its start, length, time other "
                     f"streams' kernels ran beside it, the longest of them; the kernel that ended on another "
                     f"stream just before it started, and how long before)")
        for c in t["collectives"]:
            beside = ", ".join(f"{name[:40]} {ns / 1e3:.0f}" for name, ns in c["beside"]) or "-"
            gap = "-" if c["after_gap_us"] is None else f"{c['after_gap_us']:.1f}"
            lines.append(f"  {c['at_us']:8.0f} {c['us']:7.1f} {c['beside_us']:7.1f}  {c['name'][:45]} | {beside} "
                         f"| after {c['after'][:40]} +{gap}")
    return "\n".join(lines)
