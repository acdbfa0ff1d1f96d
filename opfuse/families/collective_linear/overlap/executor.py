"""Running a :class:`~.plan.Plan` on CUDA: cuBLAS GEMMs on the caller's stream, copy-engine
copies and symmetric-memory signals on high-priority side streams.

Host cost is the point of this module: an eager call issues every instruction of its plan from
Python, so a :class:`BoundPlan` compiles its plan once, when it is bound, into one straight-line
Python function (``BoundPlan.source``; docs/PERF_NOTES.overlap.md has the numbers):

* every static operand is a constant of that function: peer views of the symmetric regions and
  their sub-views, the CUDA events, the side streams, the bound signal methods;
* stream switches call torch's C setter with literal stream ids, and events are recorded /
  waited through the C methods (``torch.cuda.set_stream`` etc. are Python wrappers of them);
* the staging buffer ``tmp`` belongs to the bound plan (reuse across calls is safe: a call's
  GEMMs come after the previous call's join, i.e. after the copies that read it);
* each per-call buffer view is sliced once, just before its first use;
* no dict lookups, no isinstance dispatch, no allocation, nothing that syncs, nothing that a CUDA
  graph capture cannot record.

Imported only where plans are bound (it touches ``torch.cuda``); CPU tests bind plans through the
``api`` seam (:mod:`.cpu_binding`).
"""

from __future__ import annotations

import functools

import torch

from ....config import config
from ....runtime.device import allocating_to_graph_pool, is_capturing, outside_graph_pool
from .plan import AUX, COMM, COMM2, COMPUTE, Barrier, Copy, Gemm, Plan, Probe, Put, Record, Sum, View, Wait, WaitEvent

__all__ = ["BoundPlan", "CudaApi", "cuda_api", "side_streams"]

_REGIONS = ("gather", "ring", "bias", "direct")
#: Per-call buffers, the keyword arguments of a compiled plan (besides ``b``).
CALL_BUFFERS = ("a", "out", "tmp", "x", "biasin")
_SIDE: dict[int, tuple] = {}
_APIS: dict[int, "CudaApi"] = {}


def side_streams(device: torch.device) -> tuple:
    """``(comm, comm2, aux)`` of ``device``, created once per process: two high-priority streams
    for copies and signals (the signal kernels are tiny and must not queue behind GEMM blocks;
    torch maps any negative priority to the highest the device offers) and a normal-priority
    second GEMM stream."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        with torch.cuda.device(index):
            _SIDE[index] = (torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=-1), torch.cuda.Stream())
    return _SIDE[index]


class CudaApi:
    """The stream/event primitives compiled plans call on one device.

    Attributes used by the generated code: ``current()`` -> the caller's current stream as a
    hashable key ``(stream_id, device_index, device_type)``; ``stream(key)`` -> its stream object
    (cached); ``set(*key)`` makes it current; ``record(event, stream)`` / ``wait(event, stream)``;
    ``new_event()``; ``side`` = ``((stream, key) for comm, comm2, aux)``. Private torch entry points
    are used when they behave as expected (probed here), else the public wrappers.
    """

    def __init__(self, index: int):
        self.index = index
        self.streams: dict = {}
        self.side = tuple((s, self.key(s)) for s in side_streams(torch.device("cuda", index)))
        C = torch._C
        self.record = C._CudaEventBase.record
        self.wait = C._CudaEventBase.wait
        self.new_event = torch.cuda.Event
        getter, setter = getattr(C, "_cuda_getCurrentStream", None), getattr(C, "_cuda_setStream", None)
        try:
            key = tuple(getter(index))
            if len(key) != 3:
                raise TypeError(key)
            with torch.cuda.device(index):
                setter(*key)  # the current stream again: a no-op that proves the positional form works
            self.current = lambda: getter(index)
            self.set = setter
        except Exception:  # noqa: BLE001 - another torch build: the public API
            def current():
                return self.key(torch.cuda.current_stream(index))

            def set_(stream_id, device_index, device_type):
                torch.cuda.set_stream(self.stream((stream_id, device_index, device_type)))

            self.current, self.set = current, set_

    @staticmethod
    def key(stream) -> tuple:
        return (stream.stream_id, stream.device_index, stream.device_type)

    def stream(self, key):
        stream = self.streams.get(key)
        if stream is None:
            stream = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
            self.streams[key] = stream
        return stream


def cuda_api(device: torch.device) -> CudaApi:
    """The :class:`CudaApi` of ``device`` (one per process and device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    api = _APIS.get(index)
    if api is None:
        api = _APIS[index] = CudaApi(index)
    return api


def _rect(t: torch.Tensor, row0: int, rows: int, col0: int, cols: int) -> torch.Tensor:
    view = t[row0:row0 + rows]
    return view if cols < 0 else view[:, col0:col0 + cols]


class BoundPlan:
    """``plan`` bound to symmetric regions on this rank and compiled (see the module doc).

    Parameters
    ----------
    plan:
        This rank's plan.
    regions:
        ``{"gather": Region, "ring": Region, ...}`` (the ones the plan uses).
    dtype:
        Element type of the regions' views.
    region_cols:
        ``{"gather": cols, "ring": cols}``: width of each region's 2-D view (rows follow from
        ``plan.shapes``).
    api:
        Stream/event primitives (default: :func:`cuda_api` of the regions' device).

    scaled:
        The GEMMs are FP8 GEMMs (``torch._scaled_mm``): a call also passes ``sa`` / ``sb`` (the
        float32 scales of ``a`` and ``b``, one element each) and ``odt`` (the output dtype). The
        regions are in ``dtype``: FP8 for a gathered operand, the output dtype for partial sums.

    A call: ``bound(b, a=..., out=..., x=..., biasin=...)``,
    ``b`` being ``[K, N]`` (any strides cuBLAS takes) and the buffers 2-D, ``biasin`` as
    ``[1, N]`` (a ``tmp`` argument is accepted and ignored: the plan owns its staging buffer).
    It returns when everything is enqueued; the caller's stream is ordered after all of it.
    """

    def __init__(self, plan: Plan, regions: dict, dtype: torch.dtype, region_cols: dict, api=None,
                 scaled: bool = False):
        self.plan = plan
        self.scaled = scaled
        self.rank = plan.rank
        self.views: dict[tuple[str, int], torch.Tensor] = {}
        for name, region in regions.items():
            rows = plan.shapes[name][0]
            shape = (rows, region_cols[name])
            need = rows * region_cols[name] * torch.empty((), dtype=dtype).element_size()
            if region.nbytes < need:
                raise ValueError(f"overlap: region {name!r} has {region.nbytes} bytes, the plan needs {need}")
            for peer in range(plan.world):
                self.views[(name, peer)] = region.peer_tensor(peer, dtype, shape)
            # torch offsets get_buffer from its allocation's base; the pool's local views come
            # from the segment tensor. They must agree, or every peer view is misplaced.
            mine, local = self.views[(name, self.rank)].data_ptr(), region.local_tensor(dtype).data_ptr()
            if mine != local:
                raise RuntimeError(
                    f"overlap: region {name!r}: the symmetric-memory handle maps this rank's view at {mine:#x}, "
                    f"the pool's segment tensor at {local:#x}; the SymmetricPool segment does not start at its "
                    f"allocation's base")
        # Signals of one plan go through one handle (any handle works for flags; sender and
        # receiver only have to agree, and every rank binds the same regions in the same order).
        first = regions.get("ring") or regions.get("direct") or regions.get("gather")
        self.handle = first.handle
        if api is None:
            api = cuda_api(self.views[(next(iter(regions)), self.rank)].device)
        self.api = api
        self.events = [api.new_event() for _ in range(plan.events)]
        device = self.views[(next(iter(regions)), self.rank)].device
        self.tmp = None
        if "tmp" in plan.shapes:  # kept for the plan's life: never in a cudagraph tree's pool (bound in a warm-up)
            make = functools.partial(torch.empty, plan.shapes["tmp"], dtype=dtype, device=device)
            warming_up = device.type == "cuda" and allocating_to_graph_pool() and not is_capturing()
            self.tmp = outside_graph_pool(make) if warming_up else make()
        self.source, self.host_calls, self.call = _Compiler(self).compile()

    def local(self, name: str) -> torch.Tensor:
        """This rank's 2-D view of region ``name`` (e.g. the gathered operand after a plan with
        ``fill_own``). Valid until this rank's next overlap call on the same region."""
        return self.views[(name, self.rank)]

    def __call__(self, b: torch.Tensor, **buffers) -> None:
        """Issue the plan (see the class doc for the arguments)."""
        self.call(b, **buffers)


class _Compiler:
    """Straight-line Python for one bound plan: constants in a namespace, per-call views as
    locals assigned before first use."""

    def __init__(self, bound: BoundPlan):
        self.bound, self.plan = bound, bound.plan
        self.ns: dict = {"_config": config}
        self.names: dict = {}  # id-ish key -> constant or local name
        self.lines: list[str] = []
        self.calls = 0
        n_out = self.plan.shapes.get("out", (0, 0))[1]
        self.n = n_out if isinstance(n_out, int) else 0

    # Names ---------------------------------------------------------------------------------

    def const(self, key, obj, prefix: str) -> str:
        name = self.names.get(key)
        if name is None:
            name = f"{prefix}{len(self.ns)}"
            self.ns[name] = obj
            self.names[key] = name
        return name

    def local(self, key, expr: str, prefix: str) -> str:
        name = self.names.get(key)
        if name is None:
            name = f"{prefix}{len(self.names)}"
            self.names[key] = name
            self.emit(f"{name} = {expr}")
        return name

    def emit(self, line: str, calls: int = 1) -> None:
        self.lines.append(line)
        self.calls += calls

    def view(self, v: View) -> str:
        """A name for the tensor of ``v``: a constant for regions and ``tmp``, a local for per-call
        buffers."""
        if v.buf in _REGIONS:
            base = self.bound.views[(v.buf, v.owner)]
            return self.const(("view", v), _rect(base, v.row0, v.rows, v.col0, v.cols), "R")
        if v.buf == "tmp" and v.owner == self.bound.rank:
            return self.const(("view", v), _rect(self.bound.tmp, v.row0, v.rows, v.col0, v.cols), "T")
        if v.owner != self.bound.rank:
            raise ValueError(f"overlap plan addresses {v.buf!r} of rank {v.owner}; only regions are shared")
        if v.buf not in CALL_BUFFERS:
            raise ValueError(f"overlap plan uses unknown buffer {v.buf!r}; per-call buffers: {CALL_BUFFERS}")
        full_rows = self.plan.shapes.get(v.buf, (None,))[0]
        if v.row0 == 0 and v.rows == full_rows and v.cols < 0:
            return v.buf
        expr = f"{v.buf}[{v.row0}:{v.row0 + v.rows}]" if v.cols < 0 else \
            f"{v.buf}[{v.row0}:{v.row0 + v.rows}, {v.col0}:{v.col0 + v.cols}]"
        return self.local(("view", v), expr, "v")

    def row(self, v: View, col0: int, cols: int) -> str:
        """Row 0 of a ``[1, N]`` view, columns ``[col0, col0 + cols)`` (``cols < 0``: all): a bias."""
        full = cols < 0 or (col0 == 0 and cols == self.n)
        if v.buf in _REGIONS:
            base = self.bound.views[(v.buf, v.owner)][v.row0]
            return self.const(("row", v, col0, cols), base if full else base[col0:col0 + cols], "R")
        expr = f"{v.buf}[{v.row0}]" if full else f"{v.buf}[{v.row0}, {col0}:{col0 + cols}]"
        return self.local(("row", v, col0, cols), expr, "v")

    def b_cols(self, col0: int, cols: int) -> str:
        if col0 == 0 and cols == self.n:
            return "b"
        return self.local(("b", col0, cols), f"b[:, {col0}:{col0 + cols}]", "v")

    def parts(self, src: View, dst: View, parts: int) -> list[str]:
        step = dst.rows
        return [self.view(View(src.buf, src.owner, src.row0 + p * step, step, src.col0, src.cols))
                for p in range(parts)]

    # Code ----------------------------------------------------------------------------------

    def compile(self):
        api, bound = self.bound.api, self.bound
        ns = self.ns
        ns.update(_current=api.current, _stream_of=api.stream, _streams=api.streams, _set=api.set,
                  _rec=api.record, _ewait=api.wait, _put=bound.handle.put_signal, _wsig=bound.handle.wait_signal,
                  _barrier=bound.handle.barrier, _mm=torch.mm, _smm=getattr(torch, "_scaled_mm", None), _addmm=torch.addmm, _addmm_=torch.Tensor.addmm_,
                  _copy=torch.Tensor.copy_, _add=torch.add, _add_=torch.Tensor.add_, _sum=torch.sum)
        streams = {COMPUTE: "_cs"}
        switch = {COMPUTE: "_set(*_ck)"}
        for name, (stream, key) in zip((COMM, COMM2, AUX), api.side):
            streams[name] = self.const(("stream", name), stream, "S")
            switch[name] = f"_set({', '.join(repr(k) for k in key)})"
        events = [self.const(("event", i), ev, "E") for i, ev in enumerate(bound.events)]
        current = COMPUTE
        for ins in self.plan.instructions:
            if isinstance(ins, Probe):
                continue
            if isinstance(ins, Record):
                self.emit(f"_rec({events[ins.event]}, {streams[ins.stream]})")
                continue
            if isinstance(ins, WaitEvent):
                self.emit(f"_ewait({events[ins.event]}, {streams[ins.stream]})")
                continue
            # Operands first: their slicing does not depend on the current stream.
            body = self.instruction(ins)
            if ins.stream != current:
                self.emit(switch[ins.stream])
                current = ins.stream
            for line, calls in body:
                self.emit(line, calls)
        head = ["def _run(b, a=None, out=None, tmp=None, x=None, biasin=None, sa=None, sb=None, odt=None):",
                "    _T = _config.peer_timeout_ms",
                "    _ck = _current()",
                "    _cs = _streams.get(_ck)",
                "    if _cs is None:",
                "        _cs = _stream_of(_ck)",
                "    try:"]
        body = ["        " + line for line in self.lines] or ["        pass"]
        tail = ["    finally:", "        _set(*_ck)"]
        source = "\n".join(head + body + tail) + "\n"
        code = compile(source, f"<overlap plan rank {self.plan.rank}>", "exec")
        exec(code, ns)  # noqa: S102 - our own generated code, from a plan's instruction list
        return source, self.calls + 3, ns["_run"]

    def instruction(self, ins) -> list[tuple[str, int]]:
        """Lines (with their number of torch calls) of one kernel-issuing instruction; operand
        views are emitted (as locals) before them."""
        if isinstance(ins, Gemm):
            dst, a = self.view(ins.dst), self.view(ins.a)
            b = self.b_cols(ins.b_col0, ins.b_cols)
            if self.bound.scaled:
                return [self.scaled_gemm(ins, dst, a, b)]
            if ins.mode == "acc":
                return [(f"_addmm_({dst}, {a}, {b})", 1)]
            if ins.bias is not None:
                # 1-D bias + beta 1: torch takes the cuBLASLt bias epilogue (no extra kernel).
                bias = self.row(ins.bias, ins.b_col0, ins.b_cols)
                return [(f"_addmm({bias}, {a}, {b}, out={dst})", 1)]
            return [(f"_mm({a}, {b}, out={dst})", 1)]
        if isinstance(ins, Copy):
            dst, src = self.view(ins.dst), self.view(ins.src)
            return [(f"_copy({dst}, {src})", 1)]
        if isinstance(ins, Sum):
            return self.sum(ins)
        if isinstance(ins, Put):
            return [(f"_put({ins.peer}, {ins.channel}, _T)", 1)]
        if isinstance(ins, Wait):
            return [(f"_wsig({ins.peer}, {ins.channel}, _T)", 1)]
        if isinstance(ins, Barrier):
            return [(f"_barrier({ins.channel}, _T)", 1)]
        raise TypeError(f"overlap: unknown instruction {ins!r}")

    def contiguous(self, v: View) -> bool:
        """Whether the tensor of ``v`` is one contiguous block (whole rows of its buffer)."""
        if v.buf in _REGIONS or v.buf == "tmp":
            return self.ns[self.view(v)].is_contiguous()
        width = self.plan.shapes.get(v.buf, (0, -1))[1]
        return v.cols < 0 or (v.col0 == 0 and v.cols == width)

    def scaled_gemm(self, ins: Gemm, dst: str, a: str, b: str) -> tuple[str, int]:
        """An FP8 GEMM writing ``dst`` (the bias, if any, in its epilogue) or, in ``"acc"`` mode,
        adding to it: ``torch._scaled_mm`` has no beta, so the product (rounded to the output
        dtype) is added by a second kernel in float32 and rounded again, as NCCL's ring rounds each
        hop. ``out=`` only for a contiguous ``dst`` (a column block is written through a copy)."""
        bias = "" if ins.bias is None else f", bias={self.row(ins.bias, ins.b_col0, ins.b_cols)}"
        product = f"_smm({a}, {b}, sa, sb{bias}, out_dtype=odt"
        if ins.mode == "acc":
            return f"_add_({dst}, {product}))", 2
        if self.contiguous(ins.dst):
            return f"{product}, out={dst})", 1
        return f"_copy({dst}, {product}))", 2

    def sum(self, ins: Sum) -> list[tuple[str, int]]:
        dst = self.view(ins.dst)
        bias = self.row(ins.bias, ins.dst.col0, ins.dst.cols) if ins.bias is not None else None
        if ins.acc:
            lines = [(f"_add_({dst}, {p})", 1) for p in self.parts(ins.src, ins.dst, ins.parts)]
            return lines + ([(f"_add_({dst}, {bias})", 1)] if bias else [])
        if ins.parts == 1:
            (p,) = self.parts(ins.src, ins.dst, 1)
            return [(f"_add({p}, {bias}, out={dst})", 1)] if bias else [(f"_copy({dst}, {p})", 1)]
        if ins.parts == 2:
            # Elementwise (opmath = fp32, one rounding), faster than a reduction over a size-2 dim.
            p0, p1 = self.parts(ins.src, ins.dst, 2)
            lines = [(f"_add({p0}, {p1}, out={dst})", 1)]
        else:
            src = self.view(ins.src)
            rows, cols = ins.dst.rows, "-1"
            stacked = self.local(("stacked", ins.src, ins.parts), f"{src}.view({ins.parts}, {rows}, {cols})", "v") \
                if ins.src.buf not in _REGIONS else self.const(
                    ("stacked", ins.src, ins.parts),
                    self.ns[src].view(ins.parts, rows, self.ns[src].shape[1]), "R")
            lines = [(f"_sum({stacked}, 0, out={dst})", 1)]
        return lines + ([(f"_add_({dst}, {bias})", 1)] if bias else [])
