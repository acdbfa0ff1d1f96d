"""Triton kernels of ``gated_activation`` over rows of a packed ``[M, 2N]`` value (``gate`` in
columns ``[0, N)``, ``up`` in ``[N, 2N)``), float32 arithmetic, one rounding per output.

Grid: ``(M, cdiv(N, BLOCK))``; row offsets in int64 (``M * row stride`` may pass 2**31).
"""

from __future__ import annotations

import triton
import triton.language as tl

SILU, GELU, GELU_TANH = 0, 1, 2


@triton.jit
def _act_and_slope(g, ACT: tl.constexpr):
    """``(act(g), act'(g))`` in float32."""
    if ACT == 0:
        s = tl.sigmoid(g)
        return g * s, s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        pdf = 0.3989422804014327 * tl.exp(-0.5 * g * g)
        return g * cdf, cdf + g * pdf
    else:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0  # tanh(inner)
        slope = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
        return 0.5 * g * (1.0 + t), slope


@triton.jit
def gated_forward_kernel(Y, Out, N, stride_y, stride_o, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(Y + row * stride_y + N + cols, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_slope(g, ACT)
    tl.store(Out + row * stride_o + cols, (a * u).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def gated_backward_kernel(DOut, Y, DY, N, stride_d, stride_y, stride_dy, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    d = tl.load(DOut + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(Y + row * stride_y + N + cols, mask=mask, other=0.0).to(tl.float32)
    a, slope = _act_and_slope(g, ACT)
    tl.store(DY + row * stride_dy + cols, (d * u * slope).to(DY.dtype.element_ty), mask=mask)
    tl.store(DY + row * stride_dy + N + cols, (d * a).to(DY.dtype.element_ty), mask=mask)
