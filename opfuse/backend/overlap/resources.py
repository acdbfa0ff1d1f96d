"""What an overlap call needs besides its tensors: the group's symmetric pool, the named regions,
and the bound plans, looked up by (group, shape) and cached.

Regions are reserved when a program is compiled (:func:`reserve_for`, called by the capability
checks on every rank in the same order, so every rank carves the same offsets). A call only looks
them up; it reserves lazily only outside CUDA-graph capture, and returns ``None`` (the caller runs
the reference) when the pool cannot provide them, which happens identically on every rank.

Region names are per shape signature (``overlap/gather/{rows}x{cols}/{itemsize}B``), so layers of
the same shape share one region; the start-of-call barrier of the plans makes that safe.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ...config import config
from ...ops import group as groups
from . import policy

__all__ = ["Context", "context", "gather_region", "ring_region", "bias_region", "direct_region", "signal_pad_bytes",
           "is_capturing"]

_CONTEXTS: dict[tuple[str, int], "Context"] = {}


def is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def signal_pad_bytes() -> int:
    """Bytes of one rank's signal pad in torch symmetric memory (2048 in older torch)."""
    from torch.distributed import _symmetric_memory as symm_mem

    getter = getattr(symm_mem, "get_signal_pad_size", None)
    return int(getter()) if getter is not None else 2048


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
    """The cached :class:`Context` of ``group_name`` on ``device``, or ``None`` when the group has
    no symmetric pool (one rank, several hosts, no peer access)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (group_name, index)
    ctx = _CONTEXTS.get(key)
    if ctx is None:
        from ..symm_pool import SymmetricPool

        pg = groups.from_name(group_name)
        pool = SymmetricPool.get(pg, torch.device("cuda", index))
        if pool is None:
            return None
        sms = torch.cuda.get_device_properties(index).multi_processor_count
        ctx = Context(pg, pool, pool.rank, pool.world_size, sms=sms)
        _CONTEXTS[key] = ctx
    return ctx


def gather_region(pool, world: int, rows: int, cols: int, itemsize: int):
    return pool.reserve(f"overlap/gather/{rows}x{cols}/{itemsize}B",
                        policy.gather_region_bytes(world, rows, cols, itemsize))


def ring_region(pool, world: int, rows: int, cols: int, itemsize: int):
    return pool.reserve(f"overlap/ring/{rows}x{cols}/{itemsize}B",
                        policy.ring_region_bytes(world, rows, cols, itemsize))


def bias_region(pool, world: int, rows: int, cols: int, itemsize: int):
    """``rows`` is always 1 (one bias vector per rank); the signature matches the other kinds."""
    return pool.reserve(f"overlap/bias/{cols}/{itemsize}B", policy.bias_region_bytes(cols, itemsize))


def direct_region(pool, world: int, rows: int, cols: int, itemsize: int):
    return pool.reserve(f"overlap/direct/{rows}x{cols}/{itemsize}B",
                        policy.direct_region_bytes(world, rows, cols, itemsize))


RESERVE = {"gather": gather_region, "ring": ring_region, "bias": bias_region, "direct": direct_region}
BYTES = {"gather": policy.gather_region_bytes, "ring": policy.ring_region_bytes,
         "direct": policy.direct_region_bytes,
         "bias": lambda world, rows, cols, itemsize: policy.bias_region_bytes(cols, itemsize)}


def chunk_setting() -> int:
    return int(config.overlap_chunks)
