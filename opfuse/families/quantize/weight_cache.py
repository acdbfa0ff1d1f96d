"""FP8 copies of weights, kept while the weight is unchanged.

Parameters stay in their dtype (the master weights); each FP8 GEMM needs them quantized (and,
for the data gradient, transposed). Quantizing once per weight version instead of once per call
matters most where a GEMM streams its weight (decode: the FP8 weight is half the bytes of a
bfloat16 one, but only if it is not re-derived from the bfloat16 one each call).

An entry is valid for one (storage, version) of the parameter: an optimizer step, ``copy_`` or
any in-place update bumps ``tensor._version``. A view (a compiled graph hands an op a fresh view of
the same parameter storage on every call, e.g. a grouped GEMM's expert weights stacked into one
storage) lives with its base: the entry is the base's, keyed by the view's offset, shape and strides
(views share their base's version counter). While a CUDA graph is being captured (or a
cudagraph tree of ``mode="reduce-overhead"`` warms one up) the cache is not read: the captured
graph quantizes on every replay, so it sees the optimizer steps taken between replays; under
``fp8.autocast(frozen_weights=True)`` (inference) it is, and the graph reads the FP8 weights made
before the capture. Nothing is stored then (the graph's memory pool owns what it allocates, and a
tree fails a pool tensor it does not track). Entries go when their parameter is freed.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from ...fp8.state import weights_frozen
from ...runtime.device import allocating_to_graph_pool

__all__ = ["cached", "clear"]

# id(weight) -> (weakref to the weight, {key: (stamp, value)}); tensors cannot key a
# WeakKeyDictionary (their == is elementwise).
_CACHE: dict[int, tuple] = {}


def cached(weight: torch.Tensor, key: str, build: Callable[[], object]):
    """``build()``'s result for ``weight`` in its current version (``key`` names the form:
    recipe, operand, layout)."""
    capturing = allocating_to_graph_pool()
    if capturing and not weights_frozen():
        return build()
    stamp = (weight.data_ptr(), weight._version)
    anchor = weight._base
    if anchor is None:
        anchor = weight
    else:
        key = (key, weight.storage_offset(), tuple(weight.shape), weight.stride())
    slot = _CACHE.get(id(anchor))
    if capturing:
        hit = slot[1].get(key) if slot is not None and slot[0]() is anchor else None
        return hit[1] if hit is not None and hit[0] == stamp else build()
    if slot is None or slot[0]() is not anchor:
        slot = (weakref.ref(anchor), {})
        _CACHE[id(anchor)] = slot
        weakref.finalize(anchor, _CACHE.pop, id(anchor), None)
    entries = slot[1]
    hit = entries.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    value = build()
    entries[key] = (stamp, value)
    return value


def clear() -> None:
    """Drop every cached FP8 weight."""
    _CACHE.clear()
