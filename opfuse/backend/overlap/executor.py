"""Running a :class:`~.plan.Plan` on CUDA: cuBLAS GEMMs on the caller's stream, copy-engine
copies and symmetric-memory signals on high-priority side streams.

A :class:`BoundPlan` resolves everything that is fixed across calls once (peer views of the
symmetric regions, CUDA events, the instruction list as tuples), so a call only slices the
per-call tensors and issues torch ops: no allocation of symmetric memory, no host
synchronisation, nothing that cannot be captured in a CUDA graph. Imported lazily (it touches
``torch.cuda``); CPU-only processes never load it.
"""

from __future__ import annotations

import torch

from .plan import AUX, COMM, COMM2, COMPUTE, Barrier, Copy, Gemm, Plan, Probe, Put, Record, Sum, View, Wait, WaitEvent

__all__ = ["BoundPlan", "side_streams", "SIGNAL_TIMEOUT_MS"]

#: ``timeout_ms`` of the signal kernels: 0 waits forever (a rank may legitimately lag by seconds,
#: e.g. on its first call). Tests set a finite value so a broken schedule traps with a message
#: naming the ranks and channel instead of hanging.
SIGNAL_TIMEOUT_MS = 0

_REGIONS = ("gather", "ring", "bias", "direct")
_SIDE: dict[int, tuple] = {}

_GEMM, _COPY, _PUT, _WAIT, _BARRIER, _RECORD, _WAIT_EVENT, _SUM = range(8)


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


def _rect(t: torch.Tensor, row0: int, rows: int, col0: int, cols: int) -> torch.Tensor:
    view = t[row0:row0 + rows]
    return view if cols < 0 else view[:, col0:col0 + cols]


class BoundPlan:
    """``plan`` bound to symmetric regions on this rank.

    Parameters
    ----------
    plan:
        This rank's plan.
    regions:
        ``{"gather": Region, "ring": Region}`` (the ones the plan uses).
    dtype:
        Element type of the regions' views.
    region_cols:
        ``{"gather": cols, "ring": cols}``: width of each region's 2-D view (rows follow from
        ``plan.shapes``).
    """

    def __init__(self, plan: Plan, regions: dict, dtype: torch.dtype, region_cols: dict):
        self.plan = plan
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
        self.events = [torch.cuda.Event() for _ in range(plan.events)]
        self.code = [self._compile(ins) for ins in plan.instructions if not isinstance(ins, Probe)]

    def local(self, name: str) -> torch.Tensor:
        """This rank's 2-D view of region ``name`` (e.g. the gathered operand after a plan with
        ``fill_own``). Valid until this rank's next overlap call on the same region."""
        return self.views[(name, self.rank)]

    def _view(self, view: View):
        """A static tensor for symmetric views, else a (name, row0, rows, col0, cols) key."""
        if view.buf in _REGIONS:
            return _rect(self.views[(view.buf, view.owner)], view.row0, view.rows, view.col0, view.cols)
        if view.owner != self.rank:
            raise ValueError(f"overlap plan addresses {view.buf!r} of rank {view.owner}; only regions are shared")
        return (view.buf, view.row0, view.rows, view.col0, view.cols)

    def _compile(self, ins):
        stream = (COMPUTE, COMM, COMM2, AUX).index(ins.stream)
        if isinstance(ins, Gemm):
            bias = None if ins.bias is None else self._view(ins.bias)
            return (_GEMM, stream, self._view(ins.dst), self._view(ins.a), ins.b_col0, ins.b_cols, ins.mode, bias)
        if isinstance(ins, Copy):
            return (_COPY, stream, self._view(ins.dst), self._view(ins.src))
        if isinstance(ins, Sum):
            return (_SUM, stream, self._view(ins.dst), self._view(ins.src), ins.parts)
        if isinstance(ins, Put):
            return (_PUT, stream, ins.peer, ins.channel)
        if isinstance(ins, Wait):
            return (_WAIT, stream, ins.peer, ins.channel)
        if isinstance(ins, Barrier):
            return (_BARRIER, stream, ins.channel)
        if isinstance(ins, Record):
            return (_RECORD, stream, self.events[ins.event])
        if isinstance(ins, WaitEvent):
            return (_WAIT_EVENT, stream, self.events[ins.event])
        raise TypeError(f"overlap: unknown instruction {ins!r}")

    def run(self, buffers: dict, b: torch.Tensor) -> None:
        """Issue the plan. ``buffers``: the per-call 2-D tensors (``a``, ``out``, ``tmp``,
        ``x``, ``biasin`` as ``[1, N]``) by name; ``b`` is ``[K, N]`` (any strides cuBLAS takes).
        Returns when everything is enqueued; the caller's stream is ordered after all of it."""
        compute = torch.cuda.current_stream()
        comm, comm2, aux = side_streams(compute.device)
        streams = (compute, comm, comm2, aux)
        handle, timeout = self.handle, SIGNAL_TIMEOUT_MS
        current = 0
        b_cols: dict[tuple[int, int], torch.Tensor] = {}

        def resolve(v):
            if isinstance(v, tuple):
                return _rect(buffers[v[0]], v[1], v[2], v[3], v[4])
            return v

        try:
            for op in self.code:
                kind, stream = op[0], op[1]
                if kind == _RECORD:
                    op[2].record(streams[stream])
                    continue
                if kind == _WAIT_EVENT:
                    streams[stream].wait_event(op[2])
                    continue
                if stream != current:
                    torch.cuda.set_stream(streams[stream])
                    current = stream
                if kind == _GEMM:
                    _, _, dst, a, col0, cols, mode, bias = op
                    key = (col0, cols)
                    bc = b_cols.get(key)
                    if bc is None:
                        bc = b if col0 == 0 and cols == b.shape[1] else b[:, col0:col0 + cols]
                        b_cols[key] = bc
                    dst, a = resolve(dst), resolve(a)
                    if mode == "acc":
                        dst.addmm_(a, bc)
                    elif bias is not None:
                        # 1-D bias + beta 1: torch takes the cuBLASLt bias epilogue (no extra kernel).
                        torch.addmm(resolve(bias)[0, col0:col0 + cols], a, bc, out=dst)
                    else:
                        torch.mm(a, bc, out=dst)
                elif kind == _COPY:
                    resolve(op[2]).copy_(resolve(op[3]))
                elif kind == _SUM:
                    dst = resolve(op[2])
                    # One reduction kernel over the stacked partials (fp32 accumulation).
                    torch.sum(resolve(op[3]).view(op[4], dst.shape[0], dst.shape[1]), 0, out=dst)
                elif kind == _PUT:
                    handle.put_signal(op[2], op[3], timeout)
                elif kind == _WAIT:
                    handle.wait_signal(op[2], op[3], timeout)
                elif kind == _BARRIER:
                    handle.barrier(op[2], timeout)
        finally:
            if current != 0:
                torch.cuda.set_stream(compute)
