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
compiled graphs call (its int key is the graph's: :func:`new_key`).
"""

from __future__ import annotations

import itertools
import logging
import threading

import torch
from torch import Tensor

from ...fp8 import numerics
from ...fp8.numerics import Quantized
from ...machinery.fused_op import graph_op
from ...runtime.device import allocating_to_graph_pool, is_capturing, outside_graph_pool
from .kernels import fast_path_reason

__all__ = ["quantize_weight", "quantize_stack", "quantize_weight_pow2", "new_key", "reserve_hint", "forget_hints",
           "dtype_name"]

#: Tile of the cast (rows x columns of the weight); 16-bit tiles are written transposed too.
_TILE_M, _TILE_N = 32, 256
#: A hint no exponent equals: the first call casts twice.
_UNSET = 1 << 20

_log = logging.getLogger("opfuse.dispatch")
_hints: dict = {}
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


def reserve_hint(key, device: torch.device) -> None:
    """Make ``key``'s hint on ``device`` now, outside any CUDA-graph memory pool: compiled graphs
    reserve theirs when they are built, because under cudagraph trees even the warm-up runs
    allocate from the graph's pool, which must hold nothing but tracked outputs."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # graphs are built under a fake mode: the hint must be real memory
        _hint(key, torch.device(device))


def forget_hints() -> None:
    """Drop every hint (the next call of each weight casts twice)."""
    with _lock:
        _hints.clear()


def _hint(key, device: torch.device, size: int = 1) -> Tensor:
    # Made on a key's first call unless reserved (reserve_hint). A first call inside a CUDA-graph
    # capture would capture the fill too, and every replay would reset the hint (correct bytes, two
    # casts each time); one inside a cudagraph tree's pool would leave an untracked tensor there.
    slot = (key, device) if size == 1 else (key, device, size)  # a stack: one exponent per matrix
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
    return max(1, min(tiles, 2 * torch.cuda.get_device_properties(device).multi_processor_count))


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
    data = torch.empty((groups, rows, cols), dtype=dtype, device=w.device)
    data_t = torch.empty((groups, cols, rows), dtype=dtype, device=w.device) if fused_t else data
    scale_inv = torch.empty(groups, dtype=torch.float32, device=w.device)
    _one_read(w, dtype, fused_t, key, create, data, data_t, scale_inv)
    return data, data_t if fused_t else data.transpose(1, 2).contiguous(), scale_inv


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
    from .triton_kernels import pow2_fixup_kernel, pow2_hinted_cast_kernel

    groups, rows, cols = w.shape
    device = w.device
    limit = numerics.fp8_max(dtype)
    hint = None if key is None else _hint(key, device, groups) if create else _hints.get(
        (key, device) if groups == 1 else (key, device, groups))
    if hint is None:
        if key is not None and (key, device) not in _unreserved:
            _unreserved.add((key, device))
            _log.info("quantize_weight_pow2: no hint reserved for key %r on %s: two casts per call", key, device)
        hint = torch.full((groups,), _UNSET, dtype=torch.int32, device=device)
    scratch = torch.zeros(groups, 2, dtype=torch.float32, device=device)  # [amax, exponent the cast used]
    tiles_m, tiles_n = -(-rows // _TILE_M), -(-cols // _TILE_N)
    pow2_hinted_cast_kernel[(tiles_m, tiles_n, groups)](w, hint, scratch, data, data_t, rows, cols, w.stride(1),
                                                        w.stride(0), FMAX=limit, WRITE_T=write_t, BM=_TILE_M,
                                                        BN=_TILE_N, num_warps=4)
    programs = _programs(device, tiles_m * tiles_n)
    pow2_fixup_kernel[(programs, groups)](w, hint, scratch, data, data_t, scale_inv, rows, cols, w.stride(1),
                                          w.stride(0), tiles_n, tiles_m * tiles_n, programs, FMAX=limit,
                                          WRITE_T=write_t, BM=_TILE_M, BN=_TILE_N, num_warps=4)


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
