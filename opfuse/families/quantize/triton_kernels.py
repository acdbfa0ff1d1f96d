"""Triton kernels that quantize activations to FP8 (the math of :mod:`opfuse.fp8.numerics`, bit for
bit: float32 products, round-to-nearest-even casts, IEEE divisions for the scales).

* :func:`amax_kernel`: ``max |x|`` of a ``[rows, cols]`` tile grid into one float32 (atomic max;
  the output starts at 0), rows at or past ``valid[0]`` skipped.
* :func:`cast_kernel`: ``saturate(x * scale)`` with ``scale = fp8_max / amax`` read on the device,
  optionally also writing the transposed bytes (the operand of a backward GEMM); program 0
  writes ``scale_inv``.
* :func:`rowwise_kernel`: one program per row: its amax (or one given per row), scale, cast and
  ``scale_inv``.

Imported only on CUDA hosts with triton.
"""

import triton
import triton.language as tl


@triton.jit
def amax_kernel(x_ptr, out_ptr, valid_ptr, rows, cols, stride, HAS_VALID: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr):
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    limit = rows
    if HAS_VALID:
        limit = tl.minimum(tl.load(valid_ptr).to(tl.int64), rows)
    mask = (offs_m[:, None] < limit) & (offs_n[None, :] < cols)
    x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride + offs_n[None, :], mask=mask, other=0.0)
    tile = tl.max(tl.max(tl.abs(x.to(tl.float32)), axis=1), axis=0)
    tl.atomic_max(out_ptr, tile)


@triton.jit
def _scale(amax, FMAX: tl.constexpr):
    return tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, FMAX, tl.float32), amax), 1.0)


@triton.jit
def cast_kernel(x_ptr, amax_ptr, q_ptr, qt_ptr, scale_inv_ptr, rows, cols, stride, FMAX: tl.constexpr,
                WRITE_T: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    scale = _scale(tl.load(amax_ptr), FMAX)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask = (offs_m[:, None] < rows) & (offs_n[None, :] < cols)
    x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride + offs_n[None, :], mask=mask, other=0.0)
    y = tl.minimum(tl.maximum(x.to(tl.float32) * scale, -FMAX), FMAX)
    tl.store(q_ptr + offs_m[:, None].to(tl.int64) * cols + offs_n[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)
    if WRITE_T:
        tl.store(qt_ptr + offs_n[:, None].to(tl.int64) * rows + offs_m[None, :],
                 tl.trans(y).to(qt_ptr.dtype.element_ty), mask=tl.trans(mask))
    if pid_m == 0 and pid_n == 0:
        tl.store(scale_inv_ptr, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))


@triton.jit
def rowwise_kernel(x_ptr, q_ptr, scale_inv_ptr, amax_ptr, cols, stride, FMAX: tl.constexpr, GIVEN_AMAX: tl.constexpr,
                   BN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = x_ptr + row * stride
    dst = q_ptr + row * cols
    if GIVEN_AMAX:  # each row's amax computed elsewhere (e.g. one per expert, repeated over its rows)
        amax = tl.load(amax_ptr + row)
    else:
        acc = tl.zeros([BN], dtype=tl.float32)
        for start in range(0, cols, BN):
            offs = start + tl.arange(0, BN)
            x = tl.load(src + offs, mask=offs < cols, other=0.0)
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
        amax = tl.max(acc, axis=0)
    scale = _scale(amax, FMAX)
    for start in range(0, cols, BN):
        offs = start + tl.arange(0, BN)
        x = tl.load(src + offs, mask=offs < cols, other=0.0)
        y = tl.minimum(tl.maximum(x.to(tl.float32) * scale, -FMAX), FMAX)
        tl.store(dst + offs, y.to(q_ptr.dtype.element_ty), mask=offs < cols)
    tl.store(scale_inv_ptr + row, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))
