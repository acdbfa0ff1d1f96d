"""The quantizer every FP8 implementation calls: Triton kernels on CUDA (:mod:`.triton_kernels`:
one read for the amax and one read + one FP8 write for the cast, or one pass per row), torch ops
(:mod:`opfuse.fp8.numerics`) elsewhere. Both give the same bytes and scales."""

from __future__ import annotations

import torch

from ...fp8 import grouped as fp8_grouped
from ...fp8 import numerics
from ...fp8.numerics import Quantized
from ...runtime.device import triton_status
from ...runtime.triton_launch import launch

__all__ = ["quantize", "quantize_stack", "quantize_group_columns", "fast_path_reason", "amax"]

_TILE_M, _TILE_N, _ROW_BLOCK = 32, 256, 1024
#: Rows up to this many elements are quantized from one read (held in registers: at most 32 float32
#: values per thread with 16 warps); longer rows are read twice, amax then cast.
ROW_ONE_READ = 16384


def fast_path_reason(x: torch.Tensor) -> str | None:
    """``None`` when the Triton kernels run on ``x``, else why not."""
    if x.device.type != "cuda":
        return "not a CUDA tensor"
    return triton_status()


def _grid(rows: int, cols: int):
    return (triton_cdiv(rows, _TILE_M), triton_cdiv(cols, _TILE_N))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def amax(x: torch.Tensor, valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[1, 1]``: ``max |x|`` of 2-D ``x`` (rows at or past ``valid_rows`` skipped: a
    Triton kernel; without them torch's infinity-norm reduction, one launch)."""
    if x.numel() == 0 or valid_rows is None or fast_path_reason(x):
        return numerics.amax(x, False, valid_rows)
    from .triton_kernels import amax_kernel

    out = torch.zeros((1, 1), dtype=torch.float32, device=x.device)
    rows, cols = x.shape
    launch(amax_kernel, _grid(rows, cols), x, out, valid_rows if valid_rows is not None else out, rows, cols,
           x.stride(0), 0, HAS_VALID=valid_rows is not None, BM=_TILE_M, BN=_TILE_N, num_warps=4)
    return out


def quantize(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, *, amax_value: torch.Tensor | None = None,
             valid_rows: torch.Tensor | None = None, transpose: bool = False):
    """2-D ``x`` quantized along its rows (:func:`opfuse.fp8.numerics.quantize`; with ``rowwise``,
    ``amax_value`` may give each row's amax, ``[rows]``); with ``transpose=True`` (one scale per
    tensor) returns ``(q, q_transposed)``, the transposed bytes written by the same pass."""
    if transpose and rowwise:
        raise ValueError("quantize(transpose=True): a transposed operand with per-row scales must be quantized "
                         "along its own rows")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.numel() == 0 or fast_path_reason(x):
        given = amax_value.reshape(-1, 1) if rowwise and amax_value is not None else amax_value
        q = numerics.quantize(x, dtype, rowwise, given, valid_rows)
        return (q, Quantized(q.data.t().contiguous(), q.scale_inv)) if transpose else q
    from .triton_kernels import cast_kernel

    if rowwise:
        if valid_rows is not None:
            raise ValueError("quantize: per-row scales take no valid_rows")
        return _rowwise_triton(x, dtype, amax_value)
    rows, cols = x.shape
    limit = numerics.fp8_max(dtype)
    data = torch.empty((rows, cols), dtype=dtype, device=x.device)
    a = amax(x, valid_rows) if amax_value is None else amax_value
    scale_inv = torch.empty((1, 1), dtype=torch.float32, device=x.device)
    # The transposed bytes in the same pass for 16-bit inputs; float32 tiles came out of tl.trans
    # wrong with triton 3.6, so those are transposed by torch.
    fused_t = transpose and x.element_size() == 2
    data_t = torch.empty((cols, rows), dtype=dtype, device=x.device) if fused_t else data
    launch(cast_kernel, _grid(rows, cols), x, a, data, data_t, scale_inv, rows, cols, x.stride(0), 0, FMAX=limit,
           WRITE_T=fused_t, BM=_TILE_M, BN=_TILE_N, num_warps=4)
    q = Quantized(data, scale_inv)
    if transpose and not fused_t:
        data_t = data.t().contiguous()
    return (q, Quantized(data_t, scale_inv)) if transpose else q


def _rowwise_triton(x: torch.Tensor, dtype: torch.dtype, amax_value: torch.Tensor | None,
                    one_read: bool | None = None) -> Quantized:
    """Per-row scales by :func:`.triton_kernels.rowwise_kernel` (``x``'s rows unit-strided);
    ``one_read`` forces the kernel's one-read (``True``) or two-read form (default: by length)."""
    from .triton_kernels import rowwise_kernel

    rows, cols = x.shape
    data = torch.empty((rows, cols), dtype=dtype, device=x.device)
    scale_inv = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    one_read = cols <= ROW_ONE_READ if one_read is None else one_read
    block = max(16, 1 << (cols - 1).bit_length()) if one_read else _ROW_BLOCK
    given = amax_value is not None
    launch(rowwise_kernel, (rows,), x, data, scale_inv, amax_value.contiguous() if given else scale_inv, cols,
           x.stride(0), FMAX=numerics.fp8_max(dtype), GIVEN_AMAX=given, BN=block, ONE_READ=one_read,
           num_warps=min(16, max(4, block // 1024)))
    return Quantized(data, scale_inv)


def quantize_stack(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stack of matrices ``w [G, R, C]`` (a grouped GEMM's experts) with one scale per matrix:
    ``(data [G, R, C], data_t [G, C, R], scale_inv [G])``, the bytes of
    ``quantize(w[g], dtype, False, transpose=True)`` for each ``g``. On CUDA two launches for the
    whole stack (every matrix's amax, then one cast writing both layouts): 6 bytes of traffic per
    16-bit element, where a torch transpose of the FP8 bytes alone reads them with a stride."""
    if w.dim() != 3:
        raise ValueError(f"quantize_stack: w must be [groups, rows, cols], got shape {tuple(w.shape)}")
    groups, rows, cols = w.shape
    w = w.contiguous()
    if w.numel() == 0 or fast_path_reason(w) or w.element_size() != 2:
        return numerics.quantize_stack(w, dtype)
    from .triton_kernels import amax_kernel, cast_kernel

    tiles = (*_grid(rows, cols), groups)
    amaxes = torch.zeros(groups, dtype=torch.float32, device=w.device)
    launch(amax_kernel, tiles, w, amaxes, amaxes, rows, cols, cols, rows * cols, HAS_VALID=False, BM=_TILE_M,
           BN=_TILE_N, num_warps=4)
    data = torch.empty((groups, rows, cols), dtype=dtype, device=w.device)
    data_t = torch.empty((groups, cols, rows), dtype=dtype, device=w.device)
    scale_inv = torch.empty(groups, dtype=torch.float32, device=w.device)
    launch(cast_kernel, tiles, w, amaxes, data, data_t, scale_inv, rows, cols, cols, rows * cols,
           FMAX=numerics.fp8_max(dtype), WRITE_T=True, BM=_TILE_M, BN=_TILE_N, num_warps=4)
    return data, data_t, scale_inv


_GROUP_SLICES, _GROUP_TILE_T, _GROUP_TILE_C = 8, 64, 128


def quantize_group_columns(t: torch.Tensor, group_sizes: torch.Tensor, layout=None) -> Quantized:
    """``t [T, C]`` (rows sorted by group) as an operand of the FP8 grouped weight gradient: the bytes
    and scales of :func:`opfuse.fp8.grouped.group_columns_operand`. ``layout``: the
    :func:`~opfuse.fp8.grouped.padded_group_ends` of ``(group_sizes, T)`` when the caller has them
    (both operands share them). On CUDA two launches and no host sync: each group's amax per column,
    then one cast writing the transposed, padded layout (2 reads of ``t``, 1 FP8 write)."""
    if t.dim() != 2:
        raise ValueError(f"quantize_group_columns: t must be [tokens, columns], got shape {tuple(t.shape)}")
    if t.numel() == 0 or fast_path_reason(t) or t.element_size() != 2:
        return fp8_grouped.group_columns_operand(t, group_sizes)
    return _group_columns_triton(t.contiguous(), group_sizes,
                                 layout or fp8_grouped.padded_group_ends(group_sizes, t.shape[0]))


def _group_columns_triton(t: torch.Tensor, group_sizes: torch.Tensor, layout) -> Quantized:
    from .triton_kernels import group_column_amax_kernel, group_column_cast_kernel

    tokens, cols = t.shape
    ends, padded_ends, padded_tokens = layout
    groups = group_sizes.shape[0]
    column_blocks = triton_cdiv(cols, _GROUP_TILE_C)
    amaxes = torch.zeros(groups, cols, dtype=torch.float32, device=t.device)
    launch(group_column_amax_kernel, (column_blocks, groups, _GROUP_SLICES), t, ends, amaxes, cols, t.stride(0),
           SLICES=_GROUP_SLICES, BT=_GROUP_TILE_T, BC=_GROUP_TILE_C, num_warps=4)
    scale, scale_inv = numerics.scales_from_amax(amaxes, torch.float8_e4m3fn)
    data = torch.empty(cols, padded_tokens, dtype=torch.float8_e4m3fn, device=t.device)
    launch(group_column_cast_kernel, (triton_cdiv(padded_tokens, _GROUP_TILE_T), column_blocks), t, ends, padded_ends,
           scale, data, groups, cols, t.stride(0), padded_tokens, FMAX=numerics.fp8_max(torch.float8_e4m3fn),
           BT=_GROUP_TILE_T, BC=_GROUP_TILE_C, GP=max(16, 1 << (groups - 1).bit_length()), num_warps=4)
    return Quantized(data, scale_inv)
