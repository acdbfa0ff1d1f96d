"""What an overlap call needs besides its tensors: the group's symmetric pool and the plans bound to
it, per (group, device), and the one home of the region names.

Regions are named per shape signature (``overlap/gather/{rows}x{cols}/{itemsize}B``), so layers
of the same shape share one region; the start-of-call barrier of the plans makes that safe.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ....runtime import symm_pool
from ....runtime.device import sm_count
from . import policy

__all__ = ["Context", "context", "region_name", "region_bytes", "signal_pad_bytes", "KINDS"]

#: Region kinds: the gathered operand, the ring's receive slots, a bias vector, the direct partials.
KINDS = ("gather", "ring", "bias", "direct")

_CONTEXTS: dict[tuple[str, int], "Context"] = {}


def signal_pad_bytes() -> int:
    """Bytes of one rank's signal pad in torch symmetric memory (2048 in older torch)."""
    from torch.distributed import _symmetric_memory as symm_mem

    getter = getattr(symm_mem, "get_signal_pad_size", None)
    return int(getter()) if getter is not None else 2048


def region_name(kind: str, rows: int, cols: int, itemsize: int) -> str:
    if kind == "bias":
        return f"overlap/bias/{cols}/{itemsize}B"
    return f"overlap/{kind}/{rows}x{cols}/{itemsize}B"


def region_bytes(kind: str, world: int, rows: int, cols: int, itemsize: int) -> int:
    if kind == "gather":
        return policy.gather_region_bytes(world, rows, cols, itemsize)
    if kind == "ring":
        return policy.ring_region_bytes(world, rows, cols, itemsize)
    if kind == "direct":
        return policy.direct_region_bytes(world, rows, cols, itemsize)
    if kind == "bias":
        return policy.bias_region_bytes(cols, itemsize)
    raise ValueError(f"overlap: region kind {kind!r}; known: {KINDS}")


@dataclasses.dataclass
class Context:
    """One group on one device: its pool and the plans bound to it."""

    group: object
    pool: object
    rank: int
    world: int
    plans: dict = dataclasses.field(default_factory=dict)
    #: SMs of the device (the GEMM-size rules of :mod:`.policy` count waves of output tiles).
    sms: int = policy.DEFAULT_SMS


def context(group_name: str, device: torch.device) -> Optional[Context]:
    """The :class:`Context` of ``group_name`` on ``device``, or ``None`` when the group has no
    symmetric pool (one rank, several hosts, no peer access; opened when a program that uses the
    group was compiled). Never collective."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (group_name, index)
    ctx = _CONTEXTS.get(key)
    if ctx is None:
        pool, _ = symm_pool.lookup(group_name, torch.device("cuda", index))
        if pool is None:
            return None
        ctx = _CONTEXTS[key] = Context(pool.group, pool, pool.rank, pool.world_size, sms=sm_count(index))
    return ctx
