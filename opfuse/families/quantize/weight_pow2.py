"""FP8 weights with power-of-two scales in one read (``TensorScaling(pow2_weight_scales=True)``).

A per-tensor scale from the current amax costs a weight two reads: one for the amax, one for the
cast (and Inductor's version of it a third pass for the transposed bytes: 7 bytes of traffic per
bf16 element, docs/PERF_NOTES.fp8.md). With the scale rounded down to a power of two
(:func:`opfuse.fp8.numerics.pow2_scales_from_amax`) the FP8 bytes depend on the amax only through
one integer, the exponent ``floor(log2(fp8_max / amax))``, and a weight's amax moves slowly from
step to step. So the cast runs with the exponent the previous call found (the *hint*), reducing the
amax in the same read; a second, tiny kernel derives the true exponent, writes ``scale_inv`` and the
hint, and casts the whole weight again only when the hint was wrong (the first call, or the amax
crossed a power of two). The output is the same bytes as the two-pass quantization in every case;
the hint decides only the cost: 4 bytes per element (read 2, write W and W.T) instead of 6-7.

The hints live here, one int32 per ``(key, device)`` on the device (never read by the host, so
CUDA graphs capture the two kernels as they are). A stale hint (a checkpoint loaded into the
weight, another weight behind the same key) costs one extra pass, never a wrong byte.

:func:`quantize_weight` is the function; ``opfuse::quantize_weight_pow2`` the custom op that
compiled graphs call (its int key is the graph's: :func:`new_key`). :func:`quantize_weights` (op
``opfuse::quantize_weights_pow2``) does the same for several same-shape weights in one launch: per
call the host cost of a cast (two Triton launches, four allocations) is paid once for all of them.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Sequence

import torch
from torch import Tensor

from ...fp8 import numerics
from ...fp8.numerics import Quantized
from ...machinery.fused_op import graph_op
from ...runtime.device import allocating_to_graph_pool, is_capturing, outside_graph_pool, sm_count
from ...runtime.triton_launch import launch
from .kernels import fast_path_reason

__all__ = ["quantize_weight", "quantize_stack", "quantize_weights", "quantize_weight_pow2", "quantize_weights_pow2",
           "new_key", "reserve_hint", "forget_hints",
           "dtype_name"]

#: Tile of the cast (rows x columns of the weight); 16-bit tiles are written transposed too.
_TILE_M, _TILE_N = 32, 256
#: A hint no exponent equals: the first call casts twice.
_UNSET = 1 << 20

_log = logging.getLogger("opfuse.dispatch")
_hints: dict = {}
_tables: dict = {}  # (key, device) -> (the weights' addresses, their int64 table on the device)
_unreserved: set = set()
_lock = threading.Lock()
_keys = itertools.count()
_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def dtype_name(dtype: torch.dtype) -> str:
    """The op's name of FP8 format ``dtype`` (``"e4m3"``, ``"e5m2"``)."""
    for name, value in _FP8.items():
        if value == dtype:
            return name
    raise ValueError(f"opfuse.fp8: {dtype} is not an FP8 format; accepted: {list(_FP8.values())}")


def new_key() -> int:
    """A hint key no other caller holds (one per weight per compiled graph)."""
    return next(_keys)


def reserve_hint(key, device: torch.device, size: int = 1) -> None:
    """Make ``key``'s hint on ``device`` now, outside any CUDA-graph memory pool: compiled graphs
    reserve theirs when they are built, because under cudagraph trees even the warm-up runs
    allocate from the graph's pool, which must hold nothing but tracked outputs. ``size``: one
    exponent per matrix of a stack (:func:`quantize_stack`, :func:`quantize_weights`)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # graphs are built under a fake mode: the hint must be real memory
        _hint(key, torch.device(device), size)


def forget_hints() -> None:
    """Drop every hint (the next call of each weight casts twice)."""
    with _lock:
        _hints.clear()


def _slot(key, device: torch.device, size: int) -> tuple:
    return (key, device) if size == 1 else (key, device, size)  # a stack: one exponent per matrix


def _hint(key, device: torch.device, size: int = 1) -> Tensor:
    # Made on a key's first call unless reserved (reserve_hint). A first call inside a CUDA-graph
    # capture would capture the fill too, and every replay would reset the hint (correct bytes, two
    # casts each time); one inside a cudagraph tree's pool would leave an untracked tensor there.
    slot = _slot(key, device, size)
    found = _hints.get(slot)
    if found is None:
        def make():
            return torch.full((size,), _UNSET, dtype=torch.int32, device=device)

        # In a cudagraph tree's warm-up the hint would land in the graph's pool, untracked.
        made = outside_graph_pool(make) if allocating_to_graph_pool() and not is_capturing() else make()
        with _lock:
            found = _hints.setdefault(slot, made)
    return found


def _programs(device: torch.device, tiles: int) -> int:
    if device.type != "cuda":  # Triton's CPU interpreter (tests)
        return max(1, min(tiles, 4))
    return max(1, min(tiles, 2 * sm_count(device.index)))


def quantize_weight(weight: Tensor, dtype: torch.dtype, transpose: bool, key=None, create: bool = True):
    """``weight`` (2-D) in FP8 ``dtype`` with one power-of-two scale: ``Quantized``, or
    ``(Quantized, Quantized of weight.T)`` with ``transpose``. ``key`` (any hashable) names the
    hint; ``None`` uses none (two passes). A key without a hint gets one made here, or with
    ``create=False`` a temporary one (two passes, nothing left allocated). Off CUDA (or without
    triton) the torch reference."""
    if weight.dim() != 2:
        raise ValueError(f"opfuse.fp8: a weight must be 2-D to quantize, got shape {list(weight.shape)}")
    _check_dtype(dtype)
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if weight.numel() == 0 or fast_path_reason(weight):
        q = numerics.quantize(weight, dtype, False, pow2=True)
        return (q, Quantized(q.data.t().contiguous(), q.scale_inv)) if transpose else q
    rows, cols = weight.shape
    fused_t = _fused_transpose(weight, transpose)
    data = torch.empty((rows, cols), dtype=dtype, device=weight.device)
    data_t = torch.empty((cols, rows), dtype=dtype, device=weight.device) if fused_t else data
    scale_inv = torch.empty((1, 1), dtype=torch.float32, device=weight.device)
    _one_read(weight.unsqueeze(0), dtype, fused_t, key, create, data.unsqueeze(0), data_t.unsqueeze(0),
              scale_inv.view(1))
    q = Quantized(data, scale_inv)
    if not transpose:
        return q
    return q, Quantized(data_t if fused_t else data.t().contiguous(), scale_inv)


def quantize_stack(w: Tensor, dtype: torch.dtype, key=None, create: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """A stack of matrices ``w [G, R, C]`` (a grouped GEMM's experts), each with its own
    power-of-two scale, in one read: ``(data [G, R, C], data_t [G, C, R], scale_inv [G])``, the bytes
    of :func:`quantize_weight` of each ``w[g]`` with ``transpose=True``. ``key`` names one hint per
    matrix (as in :func:`quantize_weight`)."""
    if w.dim() != 3:
        raise ValueError(f"opfuse.fp8: quantize_stack: w must be [groups, rows, cols], got shape {list(w.shape)}")
    _check_dtype(dtype)
    if w.numel() == 0 or fast_path_reason(w):
        return numerics.quantize_stack(w, dtype, pow2=True)
    w = w.contiguous()
    groups, rows, cols = w.shape
    fused_t = _fused_transpose(w, True)
    data, data_t, scale_inv = _stack_outputs(groups, rows, cols, dtype, w.device, fused_t)
    _one_read(w, dtype, fused_t, key, create, data, data_t, scale_inv)
    return data, _transposed(data, data_t, fused_t), scale_inv


def _stack_outputs(groups: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device,
                   fused_t: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(data [G, R, C], data_t [G, C, R] (``data`` itself unless ``fused_t``), scale_inv [G])``,
    uninitialised."""
    data = torch.empty((groups, rows, cols), dtype=dtype, device=device)
    data_t = torch.empty((groups, cols, rows), dtype=dtype, device=device) if fused_t else data
    return data, data_t, torch.empty(groups, dtype=torch.float32, device=device)


def _transposed(data: Tensor, data_t: Tensor, fused_t: bool) -> Tensor:
    """A stack's transposed bytes: the kernels' where they wrote them, else transposed here."""
    return data_t if fused_t else data.transpose(1, 2).contiguous()


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in numerics.FP8_DTYPES:
        raise ValueError(f"opfuse.fp8: {dtype} is not an FP8 format; accepted: {list(numerics.FP8_DTYPES)}")


def _fused_transpose(w: Tensor, transpose: bool) -> bool:
    # float32 tiles came out of tl.trans wrong with triton 3.6 (kernels.quantize): torch transposes those.
    return transpose and w.element_size() == 2


def _one_read(w: Tensor, dtype: torch.dtype, write_t: bool, key, create: bool, data: Tensor, data_t: Tensor,
              scale_inv: Tensor) -> None:
    """The hinted cast and its fixup over a stack ``w [G, R, C]`` (last dim contiguous), writing
    ``data [G, R, C]``, with ``write_t`` ``data_t [G, C, R]`` (else ignored), and ``scale_inv [G]``."""
    groups, rows, cols = w.shape
    hint = _resolve_hint(key, w.device, groups, create)
    _launch(w, None, groups, rows, cols, w.stride(1), w.stride(0), dtype, write_t, hint, data, data_t, scale_inv)


def _resolve_hint(key, device: torch.device, groups: int, create: bool) -> Tensor:
    """``key``'s ``[groups]`` hint on ``device`` (made if ``create``), else a temporary unset one."""
    hint = None if key is None else _hint(key, device, groups) if create else _hints.get(_slot(key, device, groups))
    if hint is None:
        if key is not None and (key, device) not in _unreserved:
            _unreserved.add((key, device))
            _log.info("quantize_weight_pow2: no hint reserved for key %r on %s: two casts per call", key, device)
        hint = torch.full((groups,), _UNSET, dtype=torch.int32, device=device)
    return hint


def _launch(w: Tensor, table: Tensor | None, groups: int, rows: int, cols: int, stride: int, group_stride: int,
            dtype: torch.dtype, write_t: bool, hint: Tensor, data: Tensor, data_t: Tensor, scale_inv: Tensor) -> None:
    """The two kernels over ``groups`` matrices of ``[rows, cols]`` (row stride ``stride``): the
    matrices ``group_stride`` elements apart from ``w``'s start, or at the addresses ``table``
    holds (``w``: the first of them, for its dtype)."""
    from .triton_kernels import pow2_fixup_kernel, pow2_hinted_cast_kernel

    limit = numerics.fp8_max(dtype)
    scratch = torch.zeros(groups, 2, dtype=torch.float32, device=w.device)  # [amax, exponent the cast used]
    tiles_m, tiles_n = -(-rows // _TILE_M), -(-cols // _TILE_N)
    by_table = table is not None
    table = table if by_table else hint  # an unread stand-in
    launch(pow2_hinted_cast_kernel, (tiles_m, tiles_n, groups), w, table, hint, scratch, data, data_t, rows, cols,
           stride, group_stride, FMAX=limit, WRITE_T=write_t, TABLE=by_table, BM=_TILE_M, BN=_TILE_N, num_warps=4)
    programs = _programs(w.device, tiles_m * tiles_n)
    launch(pow2_fixup_kernel, (programs, groups), w, table, hint, scratch, data, data_t, scale_inv, rows, cols,
           stride, group_stride, tiles_n, tiles_m * tiles_n, programs, FMAX=limit, WRITE_T=write_t, TABLE=by_table,
           BM=_TILE_M, BN=_TILE_N, num_warps=4)


def quantize_weights(weights: Sequence[Tensor], dtype: torch.dtype, transpose: bool, key=None,
                     create: bool = True) -> tuple[Tensor, Tensor | None, Tensor]:
    """Several 2-D weights of one shape and dtype, each with its own power-of-two scale, in one
    launch of each kernel: ``(data [G, R, C], data_t [G, C, R] or None, scale_inv [G])``, matrix
    ``g`` the bytes of :func:`quantize_weight` of ``weights[g]`` (``data_t`` with ``transpose``).
    The weights stay where they are: the kernels find them through a device table of their
    addresses, kept per ``key`` (one hint per weight, as in :func:`quantize_weight`) and rebuilt
    when an address changes. A rebuild cannot happen inside a CUDA-graph capture (a host-to-device
    copy); there each weight is launched alone, same bytes."""
    weights = list(weights)
    if not weights:
        raise ValueError("opfuse.fp8: quantize_weights needs at least one weight")
    first = weights[0]
    for w in weights:
        if w.dim() != 2 or w.shape != first.shape or w.dtype != first.dtype or w.device != first.device:
            raise ValueError(f"opfuse.fp8: quantize_weights takes 2-D weights of one shape, dtype and device; got "
                             f"{[(list(w.shape), str(w.dtype), str(w.device)) for w in weights]}")
    _check_dtype(dtype)
    groups, (rows, cols) = len(weights), first.shape
    if first.numel() == 0 or fast_path_reason(first):
        data, data_t, scale_inv = numerics.quantize_stack(torch.stack(weights), dtype, pow2=True)
        return data, data_t if transpose else None, scale_inv
    weights = [w if w.stride() == (cols, 1) else w.contiguous() for w in weights]
    fused_t = _fused_transpose(first, transpose)
    device = first.device
    data, data_t, scale_inv = _stack_outputs(groups, rows, cols, dtype, device, fused_t)
    hint = _resolve_hint(key, device, groups, create)
    table = _address_table(key, weights)
    if table is None:
        for g, w in enumerate(weights):
            _launch(w, None, 1, rows, cols, cols, 0, dtype, fused_t, hint[g:g + 1], data[g:g + 1], data_t[g:g + 1],
                    scale_inv[g:g + 1])
    else:
        _launch(weights[0], table, groups, rows, cols, cols, 0, dtype, fused_t, hint, data, data_t, scale_inv)
    return data, _transposed(data, data_t, fused_t) if transpose else None, scale_inv


def _address_table(key, weights: list[Tensor]) -> Tensor | None:
    """int64 ``[G]``: the weights' addresses on their device, the one kept for ``key`` while they
    stay put; ``None`` when a new one would have to be copied inside a CUDA-graph capture."""
    device = weights[0].device
    addresses = tuple(w.data_ptr() for w in weights)
    kept = None if key is None else _tables.get((key, device))
    if kept is not None and kept[0] == addresses:
        return kept[1]
    if is_capturing():
        return None

    def make():
        return torch.tensor(addresses, dtype=torch.int64).to(device)

    # In a cudagraph tree's warm-up the table would land in the graph's pool, untracked (as hints).
    table = outside_graph_pool(make) if allocating_to_graph_pool() else make()
    if key is not None:
        with _lock:
            _tables[(key, device)] = (addresses, table)
    return table


def _quantize_weight_pow2_fake(weight, key, dtype, transpose):
    rows, cols = weight.shape
    fp8 = _FP8[dtype]
    data_t = weight.new_empty((cols, rows), dtype=fp8) if transpose else weight.new_empty(0, dtype=fp8)
    return weight.new_empty((rows, cols), dtype=fp8), weight.new_empty((1, 1), dtype=torch.float32), data_t


@graph_op("opfuse::quantize_weight_pow2", _quantize_weight_pow2_fake)
def quantize_weight_pow2(weight: Tensor, key: int, dtype: str, transpose: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(data, scale_inv, data_t)`` of :func:`quantize_weight` (``data_t`` empty without
    ``transpose``). The hint it updates is not an output: it changes the cost, not the result. The
    graph reserved its hint when it was built (:func:`reserve_hint`); the op makes none itself,
    since it may run inside a CUDA-graph pool."""
    out = quantize_weight(weight, _FP8[dtype], transpose, key, create=False)
    if transpose:
        q, qt = out
        return q.data, q.scale_inv, qt.data
    return out.data, out.scale_inv, out.data.new_empty(0)


def _quantize_weights_pow2_fake(weights, key, dtype, transpose):
    first = weights[0]
    rows, cols = first.shape
    fp8 = _FP8[dtype]
    data_t = first.new_empty((len(weights), cols, rows), dtype=fp8) if transpose else first.new_empty(0, dtype=fp8)
    return (first.new_empty((len(weights), rows, cols), dtype=fp8), data_t,
            [first.new_empty((1, 1), dtype=torch.float32) for _ in weights])


@graph_op("opfuse::quantize_weights_pow2", _quantize_weights_pow2_fake)
def quantize_weights_pow2(weights: list[Tensor], key: int, dtype: str,
                          transpose: bool) -> tuple[Tensor, Tensor, list[Tensor]]:
    """``(data [G, R, C], data_t [G, C, R], scale_inv of each weight [1, 1])`` of
    :func:`quantize_weights` (``data_t`` empty without ``transpose``): what
    :func:`quantize_weight_pow2` gives each weight, in one launch for all. Its ``[G]`` hint is
    reserved when the graph is built, as there. Each scale is a tensor of its own (one copy launch
    for all): Inductor's scaled-GEMM lowering views a scalar scale's whole storage, so a scale
    sliced from a ``[G]`` tensor fails to compile (torch 2.11, ``tuned_scaled_mm``)."""
    data, data_t, scale_inv = quantize_weights(weights, _FP8[dtype], transpose, key, create=False)
    scales = [scale_inv.new_empty((1, 1)) for _ in weights]
    torch._foreach_copy_(scales, list(scale_inv.view(-1, 1, 1).unbind(0)))
    return data, data_t if transpose else data.new_empty(0), scales
