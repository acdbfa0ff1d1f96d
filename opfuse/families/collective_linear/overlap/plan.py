"""Pipelines as data: the per-rank instruction lists of the comm + GEMM overlap schedules.

A plan is the list of instructions one rank issues for one call, in host issue order, each tagged
with the stream it goes to (``compute`` = the caller's current stream, ``comm`` / ``comm2`` =
high-priority side streams for copies and signals, ``aux`` = a second GEMM stream). Independent
chunk GEMMs alternate between ``compute`` and ``aux`` (``alternate=True``) so the tail wave of one
overlaps the head of the next instead of idling SMs (wave quantization of chunked GEMMs). Two
interpreters run plans:

* :mod:`.executor` on CUDA (cuBLAS GEMMs, copy-engine copies, symmetric-memory signals);
* :mod:`.simulate` on CPU (every rank and stream of several consecutive calls, in random
  interleavings, non-atomic copies/GEMMs), which is how the schedules are tested without GPUs:
  no deadlock, every output element right, no read of data still in flight, no slot overwritten
  while a peer may still read it.

Buffers are 2-D and named; a :class:`View` names a rectangle of one rank's buffer:

``a``       the GEMM's left operand on this rank (a token shard, or all tokens)
``out``     the GEMM result
``tmp``     local staging of the ring's first hop (``[count * sub_rows, sub_cols]``)
``biasin``  this rank's bias vector as ``[1, N]``
``gather``  symmetric region: ``[world * rows, cols]``, every rank's shard in rank order
``ring``    symmetric region: receive slots of the ring, ``[(world - 1) * count * sub_rows, sub_cols]``
``bias``    symmetric region: ``[1, N]``, this rank's bias for the peer that starts its chain
``direct``  symmetric region: ``[(world - 1) * rows, N]``, every peer's partial sum of this rank's chunk

and ``b`` (the right operand, ``[K, N]``) is addressed by column range only.

The schedules themselves are built in :mod:`.schedules`. Synchronisation (see the builders for
the exact order):

* A call starts with a barrier on the comm stream, after the compute stream's work so far. When it
  completes, every rank has finished the previous call (each call ends by joining its side
  streams), so every receive slot may be overwritten: this is what makes buffer reuse across calls
  and across layers sharing a region safe, with no host-side epoch.
* Data moves by *push* (the owner's copy engine writes into the peer's region), followed by
  ``put_signal(peer, channel)``; the consumer issues ``wait_signal(sender, channel)`` on the stream
  that reads the data. Each (sender, receiver, channel) carries one signal per call.
* A call ends with the compute stream waiting for the side streams, so every buffer the side
  streams touched is free when the call returns, and CUDA-graph capture sees a joined fork.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .policy import ChannelMap

__all__ = ["View", "Gemm", "Copy", "Sum", "Put", "Wait", "Barrier", "Record", "WaitEvent", "Probe", "Plan",
           "validate", "STREAMS", "COMPUTE", "COMM", "COMM2", "AUX"]

COMPUTE, COMM, COMM2, AUX = "compute", "comm", "comm2", "aux"
STREAMS = (COMPUTE, COMM, COMM2, AUX)


@dataclasses.dataclass(frozen=True)
class View:
    """Rows ``[row0, row0 + rows)`` x cols ``[col0, col0 + cols)`` of buffer ``buf`` owned by rank
    ``owner`` (a peer's symmetric region when ``owner`` is not the issuing rank). ``cols = -1``:
    all columns."""

    buf: str
    owner: int
    row0: int
    rows: int
    col0: int = 0
    cols: int = -1


@dataclasses.dataclass(frozen=True)
class Gemm:
    """``dst = a @ b[:, cols] (+ bias[0, cols])`` (``mode="set"``; the bias goes through the
    cuBLASLt epilogue) or ``dst += a @ b[:, cols]`` (``"acc"``: the epilogue with beta = 1; no
    bias). ``bias`` is a ``[1, N]`` view (local, or a peer's symmetric slot)."""

    stream: str
    dst: View
    a: View
    b_col0: int
    b_cols: int
    mode: str = "set"
    bias: Optional[View] = None

    def __post_init__(self):
        if self.mode not in ("set", "acc") or (self.mode == "acc" and self.bias is not None):
            raise ValueError(f"Gemm: mode {self.mode!r} with bias={self.bias}; accepted: 'set' (+ bias), 'acc'")


@dataclasses.dataclass(frozen=True)
class Copy:
    """``dst = src`` (one ``cudaMemcpyAsync`` when both are contiguous: the copy engine)."""

    stream: str
    dst: View
    src: View


@dataclasses.dataclass(frozen=True)
class Sum:
    """``dst = sum_p src[p] (+ bias[0])`` where ``src`` is ``parts`` row blocks of ``dst``'s shape
    stacked (fp32 accumulation, one rounding); ``acc=True``: ``dst += ...`` (elementwise kernels:
    one for two parts or one part plus ``dst``, a reduction kernel for more)."""

    stream: str
    dst: View
    src: View
    parts: int
    acc: bool = False
    bias: Optional[View] = None


@dataclasses.dataclass(frozen=True)
class Put:
    """``put_signal(peer, channel)``: tell ``peer`` that data this stream wrote has landed."""

    stream: str
    peer: int
    channel: int


@dataclasses.dataclass(frozen=True)
class Wait:
    """``wait_signal(peer, channel)``: later work on this stream sees what ``peer`` signalled."""

    stream: str
    peer: int
    channel: int


@dataclasses.dataclass(frozen=True)
class Barrier:
    """All ranks reach this point of this stream before any goes on."""

    stream: str
    channel: int


@dataclasses.dataclass(frozen=True)
class Record:
    stream: str
    event: int


@dataclasses.dataclass(frozen=True)
class WaitEvent:
    stream: str
    event: int


@dataclasses.dataclass(frozen=True)
class Probe:
    """Simulation only: snapshot ``view`` when ``stream`` gets here (what code issued after the
    plan on that stream would read). The CUDA executor skips it."""

    stream: str
    view: View
    name: str


Instruction = Gemm | Copy | Sum | Put | Wait | Barrier | Record | WaitEvent | Probe


@dataclasses.dataclass
class Plan:
    """One rank's instructions for one call, in issue order, plus the buffer shapes they assume."""

    rank: int
    world: int
    instructions: list
    shapes: dict  # buffer name -> (rows, cols) of this rank's buffers
    events: int = 0
    channels: Optional[ChannelMap] = None

    def streams(self) -> set[str]:
        return {i.stream for i in self.instructions}


def validate(plan: Plan) -> None:
    """Static checks: every awaited event was recorded earlier in issue order (a CUDA event
    waited before it is recorded is a silent no-op), events are recorded once, and only known
    streams are used."""
    recorded: set[int] = set()
    for index, ins in enumerate(plan.instructions):
        if ins.stream not in STREAMS:
            raise ValueError(f"instruction {index} ({ins}) uses unknown stream {ins.stream!r}")
        if isinstance(ins, Record):
            if ins.event in recorded:
                raise ValueError(f"event {ins.event} recorded twice (instruction {index})")
            recorded.add(ins.event)
        elif isinstance(ins, WaitEvent) and ins.event not in recorded:
            raise ValueError(f"instruction {index} waits for event {ins.event} before it is recorded")
