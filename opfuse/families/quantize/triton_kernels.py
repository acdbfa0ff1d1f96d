"""Triton kernels that quantize activations to FP8 (the math of :mod:`opfuse.fp8.numerics`, bit for
bit: float32 products, round-to-nearest-even casts, IEEE divisions for the scales).

* :func:`amax_kernel`: ``max |x|`` of a ``[rows, cols]`` tile grid into one float32 (atomic max;
  the output starts at 0), rows at or past ``valid[0]`` skipped.
* :func:`cast_kernel`: ``saturate(x * scale)`` with ``scale = fp8_max / amax`` read on the device,
  optionally also writing the transposed bytes (the operand of a backward GEMM); program 0
  writes ``scale_inv``.

* :func:`rowwise_kernel`: one program per row: its amax (or one given per row), scale, cast and
  ``scale_inv``; a row of up to ``ROW_ONE_READ`` elements is read once (held in registers), a
  longer one twice (amax, then cast).
* :func:`pow2_hinted_cast_kernel` + :func:`pow2_fixup_kernel`: one-read quantization with a
  power-of-two scale (``opfuse.fp8.numerics.pow2_scales_from_amax``) of one matrix or of each
  matrix of a stack: the cast uses the exponent a hint holds (the previous call's) while it
  reduces the amax; the fixup derives the true exponent, writes ``scale_inv`` and the hint, and
  casts again only if the hint was wrong. The matrices of a stack may also be separate tensors of
  one shape, found through a table of their addresses (one launch for many weights).

* :func:`group_column_amax_kernel` + :func:`group_column_cast_kernel`: an operand of the grouped
  weight gradient (:func:`opfuse.fp8.grouped.group_columns_operand`): each group's amax per column,
  then the cast with those scales, written transposed into the padded token layout.

``amax_kernel`` and ``cast_kernel`` take a third grid axis for a stack of same-shaped matrices (the
experts of a grouped weight): program ``g`` of it reads matrix ``g`` (``group_stride`` elements
apart) and its own amax / scale slot; a 2-D grid is the one-matrix case.

Imported only on CUDA hosts with triton.
"""

import triton
import triton.language as tl


@triton.jit
def amax_kernel(x_ptr, out_ptr, valid_ptr, rows, cols, stride, group_stride, HAS_VALID: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr):
    group = tl.program_id(2).to(tl.int64)
    x_ptr += group * group_stride
    out_ptr += group
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
def cast_kernel(x_ptr, amax_ptr, q_ptr, qt_ptr, scale_inv_ptr, rows, cols, stride, group_stride, FMAX: tl.constexpr,
                WRITE_T: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid_m, pid_n, group = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    x_ptr += group * group_stride
    amax_ptr += group
    q_ptr += group * rows * cols
    qt_ptr += group * rows * cols
    scale_inv_ptr += group
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
                   BN: tl.constexpr, ONE_READ: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = x_ptr + row * stride
    dst = q_ptr + row * cols
    if ONE_READ:  # BN >= cols: the row is read once and kept in registers for the cast
        offs = tl.arange(0, BN)
        x = tl.load(src + offs, mask=offs < cols, other=0.0).to(tl.float32)
        if GIVEN_AMAX:
            amax = tl.load(amax_ptr + row)
        else:
            amax = tl.max(tl.abs(x), axis=0)
        scale = _scale(amax, FMAX)
        y = tl.minimum(tl.maximum(x * scale, -FMAX), FMAX)
        tl.store(dst + offs, y.to(q_ptr.dtype.element_ty), mask=offs < cols)
    else:
        if GIVEN_AMAX:  # each row's amax computed elsewhere (e.g. one per expert, repeated over its rows)
            amax = tl.load(amax_ptr + row)
        else:
            acc = tl.zeros([BN], dtype=tl.float32)
            start = 0
            while start < cols:  # while loops here: Triton's interpreter takes no tensor range() bounds
                offs = start + tl.arange(0, BN)
                x = tl.load(src + offs, mask=offs < cols, other=0.0)
                acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
                start += BN
            amax = tl.max(acc, axis=0)
        scale = _scale(amax, FMAX)
        start = 0
        while start < cols:
            offs = start + tl.arange(0, BN)
            x = tl.load(src + offs, mask=offs < cols, other=0.0)
            y = tl.minimum(tl.maximum(x.to(tl.float32) * scale, -FMAX), FMAX)
            tl.store(dst + offs, y.to(q_ptr.dtype.element_ty), mask=offs < cols)
            start += BN
    tl.store(scale_inv_ptr + row, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))


@triton.jit
def _pow2_exponent(amax, FMAX: tl.constexpr):
    """numerics.pow2_exponent: the exponent bits of the correctly rounded ``FMAX / amax``."""
    ratio = tl.math.div_rn(tl.full(amax.shape, FMAX, tl.float32), amax)
    e = ((ratio.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.minimum(tl.maximum(e, -126), 126)
    return tl.where(amax > 0, e, 0)


@triton.jit
def _pow2_cast_tile(x_ptr, q_ptr, qt_ptr, pid_m, pid_n, e, rows, cols, stride, FMAX: tl.constexpr,
                    WRITE_T: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, AMAX: tl.constexpr, amax_ptr):
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask = (offs_m[:, None] < rows) & (offs_n[None, :] < cols)
    x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride + offs_n[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    if AMAX:
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(xf), axis=1), axis=0))
    y = tl.minimum(tl.maximum(xf * scale, -FMAX), FMAX)
    tl.store(q_ptr + offs_m[:, None].to(tl.int64) * cols + offs_n[None, :], y.to(q_ptr.dtype.element_ty), mask=mask)
    if WRITE_T:
        tl.store(qt_ptr + offs_n[:, None].to(tl.int64) * rows + offs_m[None, :],
                 tl.trans(y).to(qt_ptr.dtype.element_ty), mask=tl.trans(mask))


@triton.jit
def _matrix(x_ptr, table_ptr, group, group_stride, TABLE: tl.constexpr):
    """Where matrix ``group`` of a stack starts: ``group_stride`` elements apart, or with ``TABLE``
    the address ``table_ptr[group]`` holds (an int64 per matrix)."""
    if TABLE:
        start = tl.load(table_ptr + group).to(tl.pointer_type(x_ptr.dtype.element_ty))
    else:
        start = x_ptr + group * group_stride
    return start


@triton.jit
def pow2_hinted_cast_kernel(x_ptr, table_ptr, hint_ptr, scratch_ptr, q_ptr, qt_ptr, rows, cols, stride,
                            group_stride, FMAX: tl.constexpr, WRITE_T: tl.constexpr, TABLE: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr):
    """Cast with the hint's exponent (any int32: clamped, and checked by the fixup) and reduce
    ``max |x|`` into ``scratch[0]`` (zero on entry); program 0 records the exponent used in
    ``scratch[1]``. Grid axis 2: matrix ``g`` of a stack, with hint ``g`` and ``scratch[2g:2g+2]``;
    the matrix is read ``group_stride`` elements past ``x_ptr``, or with ``TABLE`` at the address
    ``table_ptr[g]`` holds (separate tensors of one shape and dtype; ``x_ptr`` gives the type)."""
    pid_m, pid_n, group = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    x_ptr = _matrix(x_ptr, table_ptr, group, group_stride, TABLE)
    hint_ptr += group
    scratch_ptr += 2 * group
    q_ptr += group * rows * cols
    qt_ptr += group * rows * cols
    e = tl.minimum(tl.maximum(tl.load(hint_ptr), -126), 126)
    _pow2_cast_tile(x_ptr, q_ptr, qt_ptr, pid_m, pid_n, e, rows, cols, stride, FMAX, WRITE_T, BM, BN, True,
                    scratch_ptr)
    if pid_m == 0 and pid_n == 0:
        tl.store(scratch_ptr + 1, e.to(tl.float32))


@triton.jit
def pow2_fixup_kernel(x_ptr, table_ptr, hint_ptr, scratch_ptr, q_ptr, qt_ptr, scale_inv_ptr, rows, cols, stride,
                      group_stride, tiles_n, tiles, programs, FMAX: tl.constexpr, WRITE_T: tl.constexpr,
                      TABLE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The true exponent from the amax; program 0 writes ``scale_inv`` and the hint (the other
    programs read the exponent the cast used from ``scratch[1]``, never the hint, so no program
    sees the new hint); where the exponent differs from the one used, the programs cast every
    tile again, grid-stride (``programs``: the grid's size along axis 0). Grid axis 1: matrix ``g``
    of a stack, as in :func:`pow2_hinted_cast_kernel` (``scale_inv[g]``; ``TABLE`` likewise)."""
    pid, group = tl.program_id(0), tl.program_id(1).to(tl.int64)
    x_ptr = _matrix(x_ptr, table_ptr, group, group_stride, TABLE)
    hint_ptr += group
    scratch_ptr += 2 * group
    q_ptr += group * rows * cols
    qt_ptr += group * rows * cols
    scale_inv_ptr += group
    e = _pow2_exponent(tl.load(scratch_ptr), FMAX)
    used = tl.load(scratch_ptr + 1).to(tl.int32)
    if pid == 0:
        tl.store(scale_inv_ptr, ((127 - e) << 23).to(tl.float32, bitcast=True))
        tl.store(hint_ptr, e)
    if e != used:
        tile = pid
        while tile < tiles:  # grid-stride (a while loop: Triton's interpreter takes no tensor range bounds)
            _pow2_cast_tile(x_ptr, q_ptr, qt_ptr, tile // tiles_n, tile % tiles_n, e, rows, cols, stride, FMAX,
                            WRITE_T, BM, BN, False, scratch_ptr)
            tile += programs


@triton.jit
def group_column_amax_kernel(x_ptr, ends_ptr, amax_ptr, cols, stride, SLICES: tl.constexpr, BT: tl.constexpr,
                             BC: tl.constexpr):
    """``amax[g, c] = max |x[r, c]|`` over group ``g``'s rows (``amax`` zero on entry): program
    ``(c block, g, s)`` reduces slice ``s`` of ``SLICES`` of the group's rows (so one large group
    still spreads over the GPU) and combines by atomic max."""
    pid_c, group, piece = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(ends_ptr + group - 1, mask=group > 0, other=0)
    end = tl.load(ends_ptr + group)
    chunk = tl.cdiv(tl.cdiv(end - start, SLICES), BT) * BT
    lo = start + piece * chunk
    hi = tl.minimum(lo + chunk, end)
    offs_c = pid_c * BC + tl.arange(0, BC)
    acc = tl.zeros([BC], dtype=tl.float32)
    first = lo
    while first < hi:  # a while loop: bounds read on the device (the interpreter's range() takes no tensors)
        offs_r = first + tl.arange(0, BT)
        mask = (offs_r[:, None] < hi) & (offs_c[None, :] < cols)
        x = tl.load(x_ptr + offs_r[:, None].to(tl.int64) * stride + offs_c[None, :], mask=mask, other=0.0)
        acc = tl.maximum(acc, tl.max(tl.abs(x.to(tl.float32)), axis=0))
        first += BT
    if hi > lo:
        tl.atomic_max(amax_ptr + group.to(tl.int64) * cols + offs_c, acc, mask=offs_c < cols)


@triton.jit
def group_column_cast_kernel(x_ptr, ends_ptr, padded_ends_ptr, scale_ptr, q_ptr, groups, cols, stride, padded_tokens,
                             FMAX: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, GP: tl.constexpr):
    """``q[c, p] = saturate(x[row(p), c] * scale[g(p), c])`` for every padded position ``p`` of the
    tile (0 where ``p`` is padding): the row of ``p`` is its group's first row plus ``p``'s distance
    from the group's padded start."""
    pid_p, pid_c = tl.program_id(0), tl.program_id(1)
    offs_p = pid_p * BT + tl.arange(0, BT)
    every = tl.arange(0, GP)
    padded_ends = tl.load(padded_ends_ptr + every, mask=every < groups, other=2147483647)
    group = tl.sum((padded_ends[None, :] <= offs_p[:, None]).to(tl.int32), axis=1)  # == groups past the last
    g = tl.minimum(group, groups - 1)
    first = g > 0
    padded_start = tl.load(padded_ends_ptr + g - 1, mask=first, other=0)
    start = tl.load(ends_ptr + g - 1, mask=first, other=0)
    end = tl.load(ends_ptr + g)
    row = start + offs_p - padded_start
    valid = (group < groups) & (row < end)
    offs_c = pid_c * BC + tl.arange(0, BC)
    in_cols = offs_c < cols
    mask = valid[:, None] & in_cols[None, :]
    x = tl.load(x_ptr + row[:, None].to(tl.int64) * stride + offs_c[None, :], mask=mask, other=0.0)
    scale = tl.load(scale_ptr + g[:, None].to(tl.int64) * cols + offs_c[None, :], mask=mask, other=1.0)
    y = tl.minimum(tl.maximum(x.to(tl.float32) * scale, -FMAX), FMAX)
    out_mask = (offs_p[:, None] < padded_tokens) & in_cols[None, :]
    tl.store(q_ptr + offs_c[:, None].to(tl.int64) * padded_tokens + offs_p[None, :],
             tl.trans(y).to(q_ptr.dtype.element_ty), mask=tl.trans(out_mask))
