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

Inductor's generated code hands an op a fresh alias of a graph input's storage on every call (no
``_base``, a version counter of its own that starts at 0), so no version tells whether such a
weight changed. :func:`keep_for_backward` / :func:`take_for_backward` serve that case within one
step: the forward's copy is kept with the activation the backward reads with it, handed to that
backward once, and dropped with the activation at the latest (what ``ctx.save_for_backward`` would do).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from ...fp8.state import weights_frozen
from ...runtime.device import allocating_to_graph_pool

__all__ = ["cached", "keep_for_backward", "take_for_backward", "clear"]

# id(weight) -> (weakref to the weight, {key: (stamp, value)}); tensors cannot key a
# WeakKeyDictionary (their == is elementwise).
_CACHE: dict[int, tuple] = {}
# id(activation) -> (weakref to it, {(key, weight storage, geometry): value}).
_KEPT: dict[int, tuple] = {}


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


def keep_for_backward(activation: torch.Tensor, weight: torch.Tensor, key: str, value) -> None:
    """Keep ``value`` (a form of ``weight`` the forward made) for the backward called with this same
    ``activation`` tensor, as ``ctx.save_for_backward`` would: :func:`take_for_backward` hands it
    over once. Kept at most until the activation is freed; nothing is kept while a CUDA graph is
    captured (the memory would be the graph's)."""
    if allocating_to_graph_pool():
        return
    slot = _KEPT.get(id(activation))
    if slot is None or slot[0]() is not activation:
        slot = (weakref.ref(activation), {})
        _KEPT[id(activation)] = slot
        weakref.finalize(activation, _forget, id(activation), slot)
    slot[1][_entry(weight, key)] = value


def take_for_backward(activation: torch.Tensor, weight: torch.Tensor, key: str):
    """What the forward that read ``activation`` kept for ``weight`` under ``key`` (then forgotten:
    a second backward, or the next forward's, makes its own), or ``None``; always ``None`` while a
    CUDA graph is captured (the graph would read memory it does not own on every replay)."""
    slot = _KEPT.get(id(activation))
    if slot is None or slot[0]() is not activation:
        return None
    value = slot[1].pop(_entry(weight, key), None)
    return None if allocating_to_graph_pool() else value


def _entry(weight: torch.Tensor, key: str) -> tuple:
    return (key, weight.untyped_storage().data_ptr(), weight.storage_offset(), tuple(weight.shape), weight.stride(),
            weight.dtype)


def _forget(ident: int, slot) -> None:
    if _KEPT.get(ident) is slot:
        del _KEPT[ident]


def clear() -> None:
    """Drop every cached FP8 weight."""
    _CACHE.clear()
    _KEPT.clear()
