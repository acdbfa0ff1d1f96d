"""Triton kernel of the residual-norm ops that emit FP8: ``h = x [+ bias] [+ residual]``,
``y = norm(h)`` rounded to the activation dtype (what the unfused norm returns), then quantized.

One program per row (the whole row in registers). ``MODE``:

* 0: per-row scale: the row's amax, its scale, the FP8 row and ``scale_inv[row]``;
* 1: first pass of one scale per tensor: writes ``h`` (if asked) and the row's amax of ``y``;
* 2: second pass: recomputes ``y`` from the inputs and casts it with the scale from ``amax[0]``;
  program 0 writes ``scale_inv``.

Imported only on CUDA hosts with triton.
"""

import triton
import triton.language as tl


@triton.jit
def add_norm_quantize_kernel(x_ptr, bias_ptr, res_ptr, w_ptr, nb_ptr, h_ptr, q_ptr, aux_ptr, amax_ptr, cols, eps,
                             FMAX: tl.constexpr, LAYER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                             HAS_W: tl.constexpr, HAS_NB: tl.constexpr, WRITE_H: tl.constexpr, MODE: tl.constexpr,
                             BN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BN)
    mask = offs < cols
    base = row * cols
    x = tl.load(x_ptr + base + offs, mask=mask, other=0.0)
    dtype = x.dtype
    h = x
    # Each add rounds to the activation dtype, as the unfused ops do.
    if HAS_BIAS:
        h = (h.to(tl.float32) + tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    if HAS_RES:
        h = (h.to(tl.float32) + tl.load(res_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    if WRITE_H:
        tl.store(h_ptr + base + offs, h, mask=mask)
    hf = h.to(tl.float32)
    if LAYER:
        mean = tl.sum(hf, axis=0) / cols
        centred = tl.where(mask, hf - mean, 0.0)
        y = centred * tl.math.rsqrt(tl.sum(centred * centred, axis=0) / cols + eps)
    else:
        y = hf * tl.math.rsqrt(tl.sum(hf * hf, axis=0) / cols + eps)
    if HAS_W:
        y = y * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NB:
        y = y + tl.load(nb_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.where(mask, y.to(dtype).to(tl.float32), 0.0)
    if MODE == 1:
        tl.store(aux_ptr + row, tl.max(tl.abs(y), axis=0))
    else:
        if MODE == 0:
            amax = tl.max(tl.abs(y), axis=0)
        else:
            amax = tl.load(amax_ptr)
        scale = tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, FMAX, tl.float32), amax), 1.0)
        q = tl.minimum(tl.maximum(y * scale, -FMAX), FMAX)
        tl.store(q_ptr + base + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        scale_inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        if MODE == 0:
            tl.store(aux_ptr + row, scale_inv)
        elif row == 0:
            tl.store(aux_ptr, scale_inv)
