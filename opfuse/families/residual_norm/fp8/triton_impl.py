"""The ``triton`` implementation of the norms that emit FP8 (``add_rmsnorm_quantize``,
``add_layernorm_quantize``): the add, the norm and the quantization in one kernel per row
(:mod:`..triton_kernels`), the normalized activation never written in high precision.

One scale per row: one pass. One scale per tensor: a first pass writes ``h`` and each row's amax,
the amax (all-reduced over ``amax_group`` when the quantized shards are gathered next) gives the
scale, and a second pass recomputes each row from the inputs and writes FP8. Backward is the
residual-norm family's (the fused RMSNorm / LayerNorm backward kernels where the CUDA extension is
built, else the reference).
"""

from __future__ import annotations

import torch

from ....fp8 import numerics
from ....fp8.tensor import Float8Activation
from ...quantize.reference import DTYPES, tensor_amax
from ....runtime import extension
from ....runtime.device import triton_status
from ....runtime.triton_launch import launch
from .. import cuda as norm_cuda
from .. import reference

__all__ = ["check", "forward", "backward", "MAX_HIDDEN"]

MAX_HIDDEN = 32768
def check(spec) -> str | None:
    reason = norm_cuda.one_dtype_reason(spec)
    if reason:
        return reason
    if spec.x.features > MAX_HIDDEN:
        return f"hidden size {spec.x.features} > {MAX_HIDDEN} (one row per program)"
    return triton_status()


def _launch(kernel, rows, *args, **meta):
    block = 1 << max(0, meta["cols"] - 1).bit_length()
    warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    cols = meta.pop("cols")
    launch(kernel, (rows,), *args, cols, **meta, BN=block, num_warps=warps)


def forward(x, bias, residual, weight, norm_bias, eps, write_residual, dtype, rowwise, amax_group, *, norm):
    from ..triton_kernels import add_norm_quantize_kernel as kernel

    fp8 = DTYPES[dtype]
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden).contiguous()
    rows = x2.shape[0]
    res = None if residual is None else residual.reshape(-1, hidden).contiguous()
    h = torch.empty_like(x2) if write_residual else x2.new_empty(0)
    q = torch.empty((rows, hidden), dtype=fp8, device=x.device)
    vectors = [t.contiguous() if t is not None else None for t in (bias, weight, norm_bias)]
    flags = dict(FMAX=numerics.fp8_max(fp8), LAYER=norm == "layer", HAS_BIAS=bias is not None,
                 HAS_RES=res is not None, HAS_W=weight is not None, HAS_NB=norm_bias is not None)
    dummy = x2

    def operands(aux, amax):
        b, w, nb = (t if t is not None else dummy for t in vectors)
        return (x2, b, res if res is not None else dummy, w, nb, h if write_residual else dummy, q, aux, amax)

    if rows and rowwise:
        scale_inv = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
        _launch(kernel, rows, *operands(scale_inv, scale_inv), eps=float(eps), cols=hidden, **flags,
                WRITE_H=write_residual, MODE=0)
    else:
        row_amax = torch.zeros(rows, dtype=torch.float32, device=x.device)
        if rows:
            _launch(kernel, rows, *operands(row_amax, row_amax), eps=float(eps), cols=hidden, **flags,
                    WRITE_H=write_residual, MODE=1)
        amax = tensor_amax(row_amax, "" if rowwise else amax_group)
        if rows:
            scale_inv = torch.empty((1, 1), dtype=torch.float32, device=x.device)
            _launch(kernel, rows, *operands(scale_inv, amax), eps=float(eps), cols=hidden, **flags,
                    WRITE_H=False, MODE=2)
        else:
            scale_inv = numerics.scales_from_amax(amax, fp8)[1]
        if rowwise:  # zero rows: an empty per-row scale
            scale_inv = scale_inv.new_empty((0, 1))
    y = Float8Activation(q.view(x.shape), scale_inv, x.dtype)
    return y, (h.view(x.shape) if write_residual else x.new_empty(0))


def backward(dy, h, dh_out, weight, norm_bias, eps, *, norm):
    try:
        extension.load(norm_cuda.FAMILY)
    except extension.ExtensionUnavailable:
        return reference.backward(dy, h, dh_out, weight, norm_bias, eps, norm=norm)
    return norm_cuda.norm_backward(dy, h, dh_out, weight, norm_bias, eps, norm=norm)
