"""A CPU interpreter of overlap plans: every rank, every stream, several consecutive calls.

It is the executable specification the CUDA executor is held to, and how the schedules are tested
without GPUs. The model is deliberately adversarial:

* streams of all ranks advance in a random interleaving (``seed``), each lane (rank, stream)
  with its own random speed, so one rank can run a whole call ahead of a slow peer;
* a GEMM or copy is not atomic: it starts (its destination becomes NaN, its sources are
  snapshotted), other streams may run, then it finishes (writes the result); a source that
  changed in between raises :class:`Race`, a source still in flight yields NaN in the result;
* ``put_signal`` spins while the peer's slot is set, ``wait_signal`` spins until it is set and
  clears it, a barrier is a put + wait with every peer (torch's symmetric-memory semantics);
* symmetric regions persist across calls (and start as NaN), everything else is fresh per call.

A state where no stream can move while work remains raises :class:`Deadlock`.
"""

from __future__ import annotations

import random
from typing import Optional

import torch

from .plan import (AUX, COMM, COMM2, COMPUTE, Barrier, Copy, Gemm, Plan, Probe, Put, Record, Sum, View, Wait,
                   WaitEvent)

__all__ = ["Deadlock", "Race", "simulate"]

REGIONS = ("gather", "ring", "bias", "direct")


class Deadlock(RuntimeError):
    """No stream can make progress while instructions remain."""


class Race(RuntimeError):
    """A buffer was modified while a copy or GEMM was reading it."""


class _Rank:
    def __init__(self, world: int):
        self.pad: dict[tuple[int, int], int] = {}  # (channel, sender) -> 0/1
        self.events: set[tuple[int, int]] = set()  # (call, event)
        self.queues = {s: [] for s in (COMPUTE, COMM, COMM2, AUX)}
        self.pending = {s: None for s in (COMPUTE, COMM, COMM2, AUX)}
        self.barrier = {s: None for s in (COMPUTE, COMM, COMM2, AUX)}


def _rect(tensor: torch.Tensor, view: View) -> torch.Tensor:
    block = tensor[view.row0:view.row0 + view.rows]
    return block if view.cols < 0 else block[:, view.col0:view.col0 + view.cols]


def simulate(plans: list[list[Plan]], buffers: list[list[dict]], regions: list[dict], *, seed: int = 0,
             max_steps: int = 10_000_000) -> dict:
    """Run ``plans[call][rank]`` for all calls in order on every rank.

    ``buffers[call][rank]``: name -> float64 tensor (``a``, ``out``, ``tmp``, ``x``, ``b``,
    ``biasin``); ``regions[rank]``: name -> tensor (persistent). Returns ``{(call, rank, probe name):
    snapshot}``.
    """
    world = len(regions)
    rng = random.Random(seed)
    ranks = [_Rank(world) for _ in range(world)]
    for call, per_rank in enumerate(plans):
        for rank, plan in enumerate(per_rank):
            for ins in plan.instructions:
                ranks[rank].queues[ins.stream].append((call, ins))
    probes: dict = {}

    def tensor(call: int, rank: int, view: View) -> torch.Tensor:
        if view.buf in REGIONS:
            return _rect(regions[view.owner][view.buf], view)
        if view.owner != rank:
            raise AssertionError(f"rank {rank} addresses non-symmetric buffer {view.buf} of rank {view.owner}")
        return _rect(buffers[call][rank][view.buf], view)

    def sources(call, rank, ins):
        if isinstance(ins, Copy):
            return [tensor(call, rank, ins.src)]
        if isinstance(ins, Sum):
            return [tensor(call, rank, ins.src)] + ([tensor(call, rank, ins.bias)] if ins.bias is not None else [])
        bufs = buffers[call][rank]
        srcs = [tensor(call, rank, ins.a), bufs["b"][:, ins.b_col0:ins.b_col0 + ins.b_cols]]
        if ins.bias is not None:
            srcs.append(tensor(call, rank, ins.bias)[0, ins.b_col0:ins.b_col0 + ins.b_cols])
        return srcs

    def start(call, rank, ins):
        dst = tensor(call, rank, ins.dst)
        srcs = sources(call, rank, ins)
        accumulates = (isinstance(ins, Gemm) and ins.mode == "acc") or (isinstance(ins, Sum) and ins.acc)
        old = dst.clone() if accumulates else None
        snap = [s.clone() for s in srcs]
        dst.fill_(float("nan"))
        return (call, ins, snap, old)

    def finish(rank, pending):
        call, ins, snap, old = pending
        srcs = sources(call, rank, ins)
        for before, now in zip(snap, srcs):
            if not torch.equal(before.nan_to_num(7.25), now.nan_to_num(7.25)):
                raise Race(f"rank {rank} call {call}: a source of {ins} changed while it was read")
        dst = tensor(call, rank, ins.dst)
        if isinstance(ins, Sum):
            total = srcs[0].reshape(ins.parts, *dst.shape).sum(0)
            if ins.bias is not None:
                total = total + srcs[1]
            dst.copy_(total + old if ins.acc else total)
            return
        if isinstance(ins, Copy):
            if tuple(srcs[0].shape) != tuple(dst.shape):
                raise AssertionError(f"copy shape mismatch in {ins}: {tuple(srcs[0].shape)} -> {tuple(dst.shape)}")
            dst.copy_(srcs[0])
            return
        product = srcs[0] @ srcs[1]
        if ins.bias is not None:
            product = product + srcs[2]
        if ins.mode == "acc":
            product = product + old
        dst.copy_(product)

    def try_barrier(rank, stream, ins) -> Optional[bool]:
        """Advance a barrier; True when complete, False if it moved, None if stuck."""
        state = ranks[rank].barrier[stream]
        if state is None:
            state = {p: 0 for p in range(world) if p != rank}
            ranks[rank].barrier[stream] = state
        moved = False
        for peer, phase in state.items():
            if phase == 0 and ranks[peer].pad.get((ins.channel, rank), 0) == 0:
                ranks[peer].pad[(ins.channel, rank)] = 1
                state[peer] = 1
                moved = True
            elif phase == 1 and ranks[rank].pad.get((ins.channel, peer), 0) == 1:
                ranks[rank].pad[(ins.channel, peer)] = 0
                state[peer] = 2
                moved = True
        if all(phase == 2 for phase in state.values()):
            ranks[rank].barrier[stream] = None
            return True
        return False if moved else None

    def step(rank, stream) -> bool:
        """Try to advance (rank, stream); True if something happened."""
        me = ranks[rank]
        if me.pending[stream] is not None:
            finish(rank, me.pending[stream])
            me.pending[stream] = None
            me.queues[stream].pop(0)
            return True
        call, ins = me.queues[stream][0]
        if isinstance(ins, (Gemm, Copy, Sum)):
            me.pending[stream] = start(call, rank, ins)
            return True
        if isinstance(ins, Put):
            slot = (ins.channel, rank)
            if ranks[ins.peer].pad.get(slot, 0):
                return False
            ranks[ins.peer].pad[slot] = 1
        elif isinstance(ins, Wait):
            slot = (ins.channel, ins.peer)
            if not me.pad.get(slot, 0):
                return False
            me.pad[slot] = 0
        elif isinstance(ins, Barrier):
            done = try_barrier(rank, stream, ins)
            if done is None:
                return False
            if not done:
                return True
        elif isinstance(ins, Record):
            me.events.add((call, ins.event))
        elif isinstance(ins, WaitEvent):
            if (call, ins.event) not in me.events:
                return False
        elif isinstance(ins, Probe):
            probes[(call, rank, ins.name)] = tensor(call, rank, ins.view).clone()
        else:
            raise TypeError(f"unknown instruction {ins!r}")
        me.queues[stream].pop(0)
        return True

    lanes = [(r, s) for r in range(world) for s in (COMPUTE, COMM, COMM2, AUX)]
    # Lane speeds spanning 3 orders of magnitude; a weighted random order per step
    # (Efraimidis-Spirakis keys) lets fast lanes overtake slow ones by whole calls.
    speed = {lane: rng.choice((0.02, 0.3, 1.0, 5.0, 30.0)) for lane in lanes}
    for _ in range(max_steps):
        live = [lane for lane in lanes if ranks[lane[0]].queues[lane[1]]]
        if not live:
            return probes
        live.sort(key=lambda lane: -rng.random() ** (1.0 / speed[lane]))
        if not any(step(r, s) for r, s in live):
            heads = {f"rank{r}.{s}": ranks[r].queues[s][0] for r, s in live}
            raise Deadlock(f"no stream can move; heads: {heads}")
    raise Deadlock(f"not finished after {max_steps} steps")
