"""Measured choices for ``grouped_linear`` per GPU kind and size class: which implementation to try
first, and which tiles the persistent kernel uses.

Both tables are data, written by ``bench/grouped_tune.py`` on each GPU kind (it prints the entry
for the GPU it ran on) and keyed by ``torch.cuda.get_device_name()`` exactly as the driver reports
it (``"NVIDIA H100 80GB HBM3"``, ``"NVIDIA H200"``), then by the size class of the call
(:func:`size_class`). A GPU or class without an entry keeps the table order of
:mod:`.implementations` and the persistent kernel's default tiles.

:func:`order` is the dispatch hook: it moves the measured implementations to the front, fastest
first, and leaves the others behind them in table order (so an implementation added later, not
yet measured, never jumps ahead of a measured one). It is pure: it reads the call's static
shapes, the tables and the device name, which is read once per device.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import torch

from ...runtime.device import device_name
from .triton_impl import GemmConfig

__all__ = ["SIZE_CLASSES", "ORDER", "PERSISTENT_TILES", "Tiles", "size_class", "class_key", "device_name",
           "measured_order", "order", "tiles_for"]

#: Size classes by rows per group (``T / G`` over the static token count), K and N:
#: ``decode`` streams the weights (<= 16 rows per group); ``small_m`` has too few rows per group,
#: or too small a K or N, for 128x256 tiles; ``large_m`` is compute-bound.
SIZE_CLASSES = ("decode", "small_m", "large_m")
_DECODE_ROWS = 16
_SMALL_ROWS = 128
_SMALL_SIDE = 256


@dataclasses.dataclass(frozen=True)
class Tiles(GemmConfig):
    """Tile configuration of the persistent grouped GEMM (forward and dgrad)."""

    #: Programs per SM of the persistent grid (decode wants several, to keep more weight bytes in flight).
    programs_per_sm: int = 1
    #: Triton's automatic warp specialisation of the work-item loop (a TMA producer warpgroup and
    #: two consumer warpgroups that split the M tile; Hopper needs ``num_warps=4`` for it). No
    #: shipped tile sets it: that kernel did not finish on H100 with Triton 3.6.
    warp_specialize: bool = False


#: ``{device name: {class key: implementation names, fastest first}}``; class keys are the size
#: classes, ``+train`` for forward + backward (``class_key``). Measured by bench/grouped_tune.py.
#: Other GPUs take the table order. Session 4: H100 from `tools/gpu_session.sh one-gpu`
#: (docs/measurements/grouped_tune_h100_s4.txt), H200 from `x2-tests` (grouped_tune_h200_s4.txt).
ORDER: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    'NVIDIA H100 80GB HBM3': {
        'decode': ('triton', 'triton_tma', 'triton_persistent', 'torch_grouped_mm'),
        'small_m': ('triton', 'triton_persistent', 'torch_grouped_mm', 'triton_tma'),
        'small_m+train': ('torch_grouped_mm', 'triton', 'triton_tma', 'triton_persistent'),
        'large_m': ('triton_persistent', 'triton', 'triton_tma', 'torch_grouped_mm'),
        'large_m+train': ('torch_grouped_mm', 'triton_persistent', 'triton_tma', 'triton'),
    },
    'NVIDIA H200': {
        'decode': ('triton', 'triton_tma', 'triton_persistent', 'torch_grouped_mm'),
        'small_m': ('triton_persistent', 'triton', 'triton_tma', 'torch_grouped_mm'),
        'small_m+train': ('torch_grouped_mm', 'triton', 'triton_tma', 'triton_persistent'),
        'large_m': ('triton_persistent', 'triton', 'triton_tma', 'torch_grouped_mm'),
        'large_m+train': ('torch_grouped_mm', 'triton_persistent', 'triton_tma', 'triton'),
    },
}

#: ``{device name: {size class: Tiles}}`` for ``triton_persistent``; bench/grouped_tune.py
#: picks them among a few candidates; elsewhere the defaults of
#: :func:`opfuse.families.grouped_linear.persistent.default_tiles` apply.
PERSISTENT_TILES: Mapping[str, Mapping[str, Tiles]] = {
    'NVIDIA H100 80GB HBM3': {
        'decode': Tiles(16, 64, 128, num_warps=4, num_stages=4, programs_per_sm=2),
        'small_m': Tiles(128, 256, 64, num_warps=8, num_stages=3),
        'large_m': Tiles(128, 256, 64, num_warps=8, num_stages=3),
    },
    'NVIDIA H200': {
        'decode': Tiles(16, 64, 128, num_warps=4, num_stages=4, programs_per_sm=2),
        'small_m': Tiles(128, 256, 64, num_warps=8, num_stages=3),
        'large_m': Tiles(128, 256, 64, num_warps=8, num_stages=3),
    },
}


def size_class(tokens: int, groups: int, k: int, n: int) -> str:
    """``decode``, ``small_m`` or ``large_m`` for ``tokens`` rows over ``groups`` groups of
    ``[N, K]`` weights."""
    rows = tokens / max(groups, 1)
    if rows <= _DECODE_ROWS:
        return "decode"
    if rows <= _SMALL_ROWS or min(k, n) < _SMALL_SIDE:
        return "small_m"
    return "large_m"


def class_key(cls: str, training: bool) -> str:
    """The ``ORDER`` key of a size class, forward only or forward + backward."""
    return f"{cls}+train" if training else cls


def _spec_shape(spec) -> tuple[int, int, int, int]:
    groups, n, k = spec.inputs["weight"].shape
    return spec.x.shape[0], groups, k, n


def measured_order(spec, table: Mapping[str, Mapping[str, tuple[str, ...]]] | None = None) -> tuple[str, ...]:
    """The measured implementation names for this call, fastest first (``()`` when unmeasured).
    Training calls fall back to the forward-only entry of their class."""
    table = ORDER if table is None else table
    entry = table.get(device_name(spec.device) or "", {})
    cls = size_class(*_spec_shape(spec))
    return tuple(entry.get(class_key(cls, spec.requires_grad)) or entry.get(cls) or ())


def order(spec, impls: Sequence, table: Mapping[str, Mapping[str, tuple[str, ...]]] | None = None) -> list:
    """``impls`` with the measured ones first, in measured order, the rest after them in table order."""
    measured = measured_order(spec, table)
    if not measured:
        return list(impls)
    rank = {name: i for i, name in enumerate(measured)}
    first = sorted((impl for impl in impls if impl.name in rank), key=lambda impl: rank[impl.name])
    return first + [impl for impl in impls if impl.name not in rank]


def tiles_for(device: torch.device, cls: str,
              table: Mapping[str, Mapping[str, Tiles]] | None = None) -> Tiles | None:
    """The measured persistent-kernel tiles of this GPU and size class, or ``None``."""
    table = PERSISTENT_TILES if table is None else table
    return table.get(device_name(device) or "", {}).get(cls)
