"""``SymmetricPool``: peer-accessible workspace per process group, from torch symmetric memory.

Each pool owns one or more *segments*: buffers allocated with
``torch.distributed._symmetric_memory.empty`` and rendezvoused once over the group, so every
rank can read and write every other rank's segment through the pointers the handle hands out
(``buffer_ptrs`` / ``buffer_ptrs_dev``). Kernels get *regions*: fixed ``(segment, offset,
nbytes)`` slices reserved by name when a program is compiled. Regions never move, so CUDA graphs
that captured their pointers stay valid.

Rules that keep this safe:

* Reservations are collective in effect: every rank compiles the same program in the same order,
  so every rank reserves the same regions at the same offsets (a kernel on rank r addresses its
  peers' regions with its own offsets).
* The pool grows (a new segment, sized ``OPFUSE_SYMM_POOL_MB`` or the request if larger) only
  outside CUDA-graph capture and while the total stays under ``OPFUSE_SYMM_POOL_MAX_MB``;
  otherwise :meth:`reserve` returns ``None``. :meth:`can_reserve_all` answers the same question
  without reserving (capability checks are pure), so the caller falls back instead of failing.
* A group whose ranks are not all on one host, or whose GPUs cannot map each other's memory,
  gets no pool. :func:`open_pool` finds out (collectively, once per group and device, when a
  program that uses the group is compiled); :func:`lookup` then answers from the cache.
"""

from __future__ import annotations

import dataclasses
import socket

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .. import log
from ..config import config
from ..ops import group as groups
from .device import is_capturing

__all__ = ["SymmetricPool", "Region", "open_pool", "lookup"]

_ALIGN = 256
_POOLS: dict[tuple[str, int], "SymmetricPool"] = {}
_UNAVAILABLE: dict[tuple[str, int], str] = {}


@dataclasses.dataclass(frozen=True)
class Region:
    """``nbytes`` at ``offset`` of segment ``segment`` (the same on every rank)."""

    pool: "SymmetricPool"
    segment: int
    offset: int
    nbytes: int

    @property
    def handle(self):
        return self.pool.segments[self.segment].handle

    def local_ptr(self) -> int:
        return self.pool.segments[self.segment].tensor.data_ptr() + self.offset

    def peer_ptrs(self) -> list[int]:
        """Device addresses of this region on every rank, in rank order."""
        seg = self.pool.segments[self.segment]
        return [ptr + seg.base_offset + self.offset for ptr in seg.handle.buffer_ptrs]

    def local_tensor(self, dtype: torch.dtype = torch.uint8, shape=None) -> torch.Tensor:
        """This rank's part of the region as a tensor view (no copy)."""
        seg = self.pool.segments[self.segment]
        element = torch.empty((), dtype=dtype).element_size()
        count = self.nbytes // element
        view = seg.tensor[self.offset:self.offset + count * element].view(dtype)
        return view if shape is None else view.view(shape)

    def peer_tensor(self, rank: int, dtype: torch.dtype, shape) -> torch.Tensor:
        """Rank ``rank``'s part of the region as a tensor (peer memory, through the handle)."""
        seg = self.pool.segments[self.segment]
        element = torch.empty((), dtype=dtype).element_size()
        start = seg.base_offset + self.offset
        if start % element:
            raise ValueError(f"Region at offset {start} is not aligned for {dtype}")
        return seg.handle.get_buffer(rank, tuple(shape), dtype, start // element)


@dataclasses.dataclass
class _Segment:
    tensor: torch.Tensor
    handle: object
    #: tensor.data_ptr() - handle.buffer_ptrs[rank]: torch may place a symmetric tensor inside a
    #: larger symmetric allocation; the offset is the same on every rank, so peer addresses are
    #: buffer_ptrs[peer] + base_offset.
    base_offset: int = 0
    used: int = 0

    @property
    def size(self) -> int:
        return self.tensor.numel()


class SymmetricPool:
    """Symmetric workspace for one process group on this process's current CUDA device."""

    def __init__(self, group, device: torch.device):
        self.group = groups.resolve(group)
        self.group_name = self.group.group_name
        self.device = device
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.segments: list[_Segment] = []
        self.regions: dict[str, Region] = {}

    # Construction -------------------------------------------------------------------------

    @classmethod
    def _open(cls, pg, device: torch.device, key) -> "SymmetricPool | None":
        reason = cls._probe(pg, device)
        if reason is not None:
            _UNAVAILABLE[key] = reason
            return None
        pool = cls(pg, device)
        try:
            pool._add_segment(config.symm_pool_mb << 20)
        except Exception as error:  # rendezvous failures: no IPC/P2P between these GPUs, etc.
            _UNAVAILABLE[key] = f"symmetric memory rendezvous failed: {type(error).__name__}: {error}"
            return None
        _POOLS[key] = pool
        return pool

    @staticmethod
    def _probe(pg, device: torch.device) -> str | None:
        if device.type != "cuda" or not torch.cuda.is_available():
            return "needs CUDA"
        if is_capturing():
            return "cannot create a symmetric pool during CUDA-graph capture"
        if dist.get_world_size(pg) < 2:
            return "group has one rank"
        hosts = [None] * dist.get_world_size(pg)
        dist.all_gather_object(hosts, socket.gethostname(), group=pg)
        if len(set(hosts)) != 1:
            return f"group spans hosts {sorted(set(hosts))}; peer memory needs one host (NVLink)"
        return None

    def _add_segment(self, nbytes: int) -> _Segment:
        from torch.distributed import _symmetric_memory as symm_mem

        nbytes = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not getattr(symm_mem, "is_symm_mem_enabled_for_group", lambda _: True)(self.group_name):
            enable(self.group_name)
        tensor = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
        handle = symm_mem.rendezvous(tensor, self.group)
        segment = _Segment(tensor, handle, base_offset=tensor.data_ptr() - handle.buffer_ptrs[self.rank])
        self.segments.append(segment)
        return segment

    # Regions ------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return sum(s.size for s in self.segments)

    def can_reserve_all(self, items: list[tuple[str, int]]) -> bool:
        """Whether reserving every ``(name, nbytes)`` of ``items``, in order, would succeed now
        (changes nothing)."""
        used = [s.used for s in self.segments]
        sizes = [s.size for s in self.segments]
        for name, nbytes in items:
            region = self.regions.get(name)
            if region is not None:
                if region.nbytes < nbytes:
                    return False
                continue
            nbytes = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
            index = next((i for i, (u, s) in enumerate(zip(used, sizes)) if s - u >= nbytes), None)
            if index is None:
                grow = max(config.symm_pool_mb << 20, nbytes)
                if is_capturing() or sum(sizes) + grow > config.symm_pool_max_mb << 20:
                    return False
                used.append(0)
                sizes.append(grow)
                index = len(sizes) - 1
            used[index] += nbytes
        return True

    def reserve(self, name: str, nbytes: int) -> Region | None:
        """The region called ``name`` (reserved on first request), or ``None`` if it does not fit
        and the pool may not grow now."""
        region = self.regions.get(name)
        if region is not None:
            if region.nbytes >= nbytes:
                return region
            return None  # same name, larger request: the caller sizes regions by name
        nbytes = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        for index, segment in enumerate(self.segments):
            if segment.size - segment.used >= nbytes:
                return self._carve(name, index, nbytes)
        if is_capturing():
            return None
        limit = config.symm_pool_max_mb << 20
        size = max(config.symm_pool_mb << 20, nbytes)
        if self.capacity + size > limit:
            return None
        self._add_segment(size)
        log.pool_growth(self.group_name, size / 2**20, self.capacity / 2**20, config.symm_pool_max_mb, name)
        return self._carve(name, len(self.segments) - 1, nbytes)

    def _carve(self, name: str, index: int, nbytes: int) -> Region:
        segment = self.segments[index]
        region = Region(self, index, segment.used, nbytes)
        segment.used += nbytes
        self.regions[name] = region
        return region


def _key(group_name: str, device: torch.device | None) -> tuple[str, int]:
    if device is not None and device.index is not None:
        return group_name, device.index
    return group_name, torch.cuda.current_device()


def open_pool(group, device: torch.device | None = None) -> "SymmetricPool | None":
    """The pool of ``group`` on ``device`` (default: the current CUDA device), created on first
    call; ``None`` when the group cannot use peer memory (:func:`lookup` says why). Collective
    on its first call for a group and device: every rank must call it in the same order."""
    pg = groups.resolve(group)
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    key = _key(pg.group_name, device)
    if key in _POOLS:
        return _POOLS[key]
    if key in _UNAVAILABLE:
        return None
    # Collective and allocating: real tensors, also when the first caller runs inside a
    # fake-tensor mode (torch.compile's joint-graph pass, where opfuse selects implementations).
    with unset_fake_temporarily():
        return SymmetricPool._open(pg, device, key)


def lookup(group_name: str, device: torch.device | None = None) -> tuple["SymmetricPool | None", str | None]:
    """``(pool, None)`` for a group whose pool :func:`open_pool` created, else ``(None, reason)``.
    Pure: never creates anything."""
    key = _key(group_name, device)
    if key in _POOLS:
        return _POOLS[key], None
    if key in _UNAVAILABLE:
        return None, _UNAVAILABLE[key]
    return None, "peer memory was not set up for this group (no program using it was compiled on this device)"
