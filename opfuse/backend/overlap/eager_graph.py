"""Eager overlap calls replayed from a CUDA graph of their plan.

An eager call issues one launch per plan instruction, and on the lent GPU hosts a launch costs
host time the GPU work often does not cover: ``bench/host_primitives.py`` measured 6 us for a bare
kernel launch and 14-16 us for a cuBLAS GEMM, and ``bench/overlap.py --world 8`` measured 682 us
of issue time per direct reduce-scatter call at M = 2048 against 318 us of GPU time (its CUDA
graph). A plan is straight-line code whose addresses are all static except the per-call buffers
and ``b``, so it can be captured once against static copies of the per-call buffers and replayed:
per call, one copy per input buffer, the replay and one copy of the output — four launches
instead of dozens, for ``2 x`` the per-call buffers' bytes of extra memory traffic.

:class:`PlanGraphs` does that for one :class:`~.executor.BoundPlan`, under
``config.overlap_eager_graphs`` (``OPFUSE_OVERLAP_EAGER_GRAPHS``):

* ``"off"``: never; ``"on"``: always (where possible); ``"auto"`` (default): when
  :func:`estimate` predicts the replay is faster, i.e. when the call is bound by its issue time;
* the first call with a given ``b`` (address, shape, strides, dtype) runs directly (it also warms
  cuBLAS up for the shapes); the second captures and replays; later ones replay. At most
  :data:`MAX_GRAPHS` graphs per plan are kept (least recently used dropped); after
  :data:`MAX_CAPTURES` captures (``b`` at a new address every call, e.g. weights re-materialised
  each step) the plan goes back to direct issue for good;
* never while the caller is capturing (``opfuse.graphed``, torch.compile's CUDA graphs): the
  plan is then issued straight into the outer graph, as before.

Replays are exact: the same kernels on the same operands as a direct call.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional

import torch

from ...config import config
from .plan import Copy, Gemm

__all__ = ["PlanGraphs", "estimate", "HOST_US_PER_CALL", "MAX_GRAPHS", "MAX_CAPTURES", "MAX_SEEN"]

#: Host time per torch call of an eager plan on the lent H100/H200 hosts (bench/overlap.py ``host``
#: column over the plans' host calls: 7.2 us at world 4, 8.3 us at world 8; a bare launch is 6 us).
HOST_US_PER_CALL = 8.0
#: Throughput assumed for the GPU-time estimate: dense bf16 GEMMs of these sizes on H100/H200
#: (bench/overlap.py ``gemm`` column: 600-780 TFLOP/s), NVLink egress per rank when every rank
#: pushes (bench/push_bandwidth.py at world 4: ~230 GB/s), HBM for the static-buffer copies.
GEMM_FLOPS_PER_US = 600e6
LINK_BYTES_PER_US = 200e3
HBM_BYTES_PER_US = 3000e3
#: Replay only when it is predicted to be at least this much faster (the estimate is rough).
MIN_GAIN = 0.9
MAX_GRAPHS = 2
MAX_CAPTURES = 8
#: Distinct ``b`` seen once each (not yet captured) before the plan stops trying.
MAX_SEEN = 32
#: Per-call buffers a plan reads (copied in before a replay) and writes (copied out after).
INPUTS = ("a", "x", "biasin")
OUTPUTS = ("out",)

_POOLS: dict[int, object] = {}


def _nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def estimate(bound, b: torch.Tensor, buffers: dict) -> dict:
    """Predicted microseconds of one call issued directly and replayed from a graph:
    ``{"direct", "graph", "gpu", "host_direct", "host_graph", "copies"}``. A call takes the
    longer of its issue time and its GPU time."""
    k = b.shape[0]
    flops = sum(2 * ins.a.rows * k * ins.b_cols for ins in bound.plan.instructions if isinstance(ins, Gemm))
    remote = 0
    for ins in bound.plan.instructions:
        if isinstance(ins, Copy) and ins.dst.owner != bound.rank and (ins.dst.buf, ins.dst.owner) in bound.views:
            view = bound.views[(ins.dst.buf, ins.dst.owner)]
            cols = view.shape[1] if ins.dst.cols < 0 else ins.dst.cols
            remote += ins.dst.rows * cols * view.element_size()
    gpu = max(flops / GEMM_FLOPS_PER_US, remote / LINK_BYTES_PER_US)
    moved = sum(_nbytes(buffers.get(name)) for name in INPUTS + OUTPUTS)
    copies = 2 * moved / HBM_BYTES_PER_US
    host_direct = bound.host_calls * HOST_US_PER_CALL
    launches = sum(1 for name in INPUTS + OUTPUTS if buffers.get(name) is not None) + 1
    host_graph = launches * HOST_US_PER_CALL
    return {"direct": max(host_direct, gpu), "graph": max(host_graph, gpu + copies), "gpu": gpu,
            "host_direct": host_direct, "host_graph": host_graph, "copies": copies}


def _eligible(b: torch.Tensor) -> bool:
    """A CUDA call from a stream that is not being captured."""
    return b.is_cuda and not torch.cuda.is_current_stream_capturing()


def _cuda_capture(fn: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """Capture ``fn`` into a CUDA graph (on a side stream: the caller's may be the legacy default
    stream, which cannot capture) and return its ``replay``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    pool = _POOLS.get(index)
    if pool is None:
        # One pool for every plan graph of the device: replays are ordered on the caller's
        # stream (a graph launch completes as a unit), so their allocations never overlap.
        pool = _POOLS[index] = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device=index)
    stream.wait_stream(torch.cuda.current_stream(index))
    with torch.cuda.stream(stream):
        # thread_local: CUDA calls of other threads (NCCL's watchdog) stay legal during capture.
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream(index).wait_stream(stream)
    return graph.replay


class PlanGraphs:
    """Eager calls of one bound plan, issued directly or replayed from graphs (module doc).

    Seams CPU tests replace: ``capture(fn, device) -> replay`` (default: a CUDA graph of ``fn``)
    and ``eligible(b) -> bool`` (default: a CUDA operand, the caller's stream not capturing)."""

    def __init__(self, bound, capture=None, eligible=None):
        self.bound = bound
        self._capture = capture or _cuda_capture
        self._eligible = eligible or _eligible
        self.graphs: collections.OrderedDict = collections.OrderedDict()
        self.seen: set = set()
        self.static: Optional[dict] = None
        self.captures = 0
        self.replays = 0
        self.auto: Optional[bool] = None
        self.estimate: Optional[dict] = None
        #: Why this plan no longer uses graphs ("" while it may).
        self.disabled = ""

    def state(self) -> dict:
        """What the plan does in eager mode now (for benchmarks and debugging)."""
        return {"setting": config.overlap_eager_graphs, "auto": self.auto, "graphs": len(self.graphs),
                "captures": self.captures, "replays": self.replays, "disabled": self.disabled,
                "estimate": self.estimate}

    def wants_graph(self, b: torch.Tensor, buffers: dict) -> bool:
        setting = config.overlap_eager_graphs  # validated by opfuse.config
        if setting == "off" or self.disabled:
            return False
        if setting == "auto":
            if self.auto is None:
                self.estimate = estimate(self.bound, b, buffers)
                self.auto = self.estimate["graph"] < MIN_GAIN * self.estimate["direct"]
            return self.auto
        return True

    def __call__(self, b: torch.Tensor, buffers: dict) -> None:
        direct = self.bound._fn
        if not self._eligible(b) or not self.wants_graph(b, buffers):
            direct(b, **buffers)
            return
        signature = tuple((name, tuple(t.shape), t.dtype) for name, t in sorted(buffers.items()) if t is not None)
        key = (b.data_ptr(), tuple(b.shape), tuple(b.stride()), b.dtype, signature)
        replay = self.graphs.get(key)
        if replay is None:
            if key not in self.seen:
                if len(self.seen) >= MAX_SEEN:
                    self.disabled = f"b came at {MAX_SEEN} addresses without repeating one; issuing directly"
                else:
                    self.seen.add(key)
                direct(b, **buffers)
                return
            replay = self._new_graph(key, b, buffers)
            if replay is None:
                direct(b, **buffers)
                return
        else:
            self.graphs.move_to_end(key)
        static = self.static
        for name in INPUTS:
            src = buffers.get(name)
            if src is not None:
                static[name].copy_(src)
        replay()
        self.replays += 1
        for name in OUTPUTS:
            dst = buffers.get(name)
            if dst is not None:
                dst.copy_(static[name])

    def _new_graph(self, key, b: torch.Tensor, buffers: dict):
        if self.captures >= MAX_CAPTURES:
            self.disabled = (f"captured {self.captures} graphs (b moves between calls); "
                             "issuing directly from now on")
            return None
        if self.static is None:
            self.static = {name: torch.empty(t.shape, dtype=t.dtype, device=t.device)
                           for name, t in buffers.items() if t is not None}
        elif set(self.static) != {name for name, t in buffers.items() if t is not None} or any(
                tuple(self.static[name].shape) != tuple(t.shape) or self.static[name].dtype != t.dtype
                for name, t in buffers.items() if t is not None):
            return None  # another buffer layout than the first graph's: not worth a second set
        static, fn = self.static, self.bound._fn
        try:
            replay = self._capture(lambda: fn(b, **static), b.device)
        except Exception as error:  # noqa: BLE001 - a capture failure must not fail the call
            self.disabled = f"capture failed: {type(error).__name__}: {error}"
            return None
        self.captures += 1
        self.graphs[key] = replay
        if len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        self.seen.discard(key)
        return replay
