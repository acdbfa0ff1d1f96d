"""The peer-memory kernels of :mod:`.cuda` with their FP8 epilogue: ``cuda_oneshot``,
``cuda_twoshot_lamport`` and ``cuda_twoshot`` of ``allreduce_add_rmsnorm_quantize``.

The all-reduce, the add and the norm are the kernels of ``allreduce_add_rmsnorm`` (same peer
regions, same crossovers, same checks and preparation); only the row finish differs (``row.cuh``):

* one scale per row: one kernel; each row's amax of ``y`` (rounded to the activation dtype), its
  scale, the FP8 row and its ``scale_inv``; ``y`` is never written in the activation dtype;
* one scale per tensor: the peer kernel writes ``h`` (always) and each row's amax of ``y``; the
  amax of the tensor (all-reduced over ``amax_group`` when set) gives the scale; the single-GPU
  norm kernel (``add_norm`` over ``h``, the same row layout, so the same statistics and the same
  ``y`` bit for bit) casts each row to FP8.

The scale math is :mod:`opfuse.fp8.numerics`' (float32, IEEE divisions), so the FP8 bytes equal the
reference quantizer's for the same ``y``. Backward is the family's (:func:`..cuda.norm_backward`).
"""

from __future__ import annotations

import torch

from ....fp8 import numerics
from ....fp8.tensor import Float8Activation
from ....ops.base import dtype_name
from ...quantize.reference import DTYPES, tensor_amax
from ....runtime import extension
from ....runtime.device import current_stream, sm_count
from .. import cuda

__all__ = ["oneshot_forward", "twoshot_forward", "lamport_forward", "OP"]

OP = "allreduce_add_rmsnorm_quantize"


def _forward(kind: str):
    def forward(x, bias, residual, weight, norm_bias, eps, group, write_residual, dtype, rowwise, amax_group, *,
                norm):
        x, residual, bias, weight, norm_bias = cuda.operands(x, bias, residual, weight, norm_bias)
        ext = extension.load(cuda.FAMILY)
        fp8, code = DTYPES[dtype], ext.FP8_FORMATS[dtype]
        hidden = x.shape[-1]
        rows = x.numel() // hidden
        q = torch.empty(x.shape, dtype=fp8, device=x.device)
        f32 = dict(dtype=torch.float32, device=x.device)
        launch = dict(norm=norm, op=OP)
        if rowwise:
            h = torch.empty_like(x) if write_residual else x.new_empty(0)
            scale_inv = torch.empty((rows, 1), **f32)
            epilogue = ext.Fp8Epilogue(ext.QUANT["rowwise"], code, q.data_ptr(), scale_inv.data_ptr())
            cuda.peer_launch(kind, x, bias, residual, weight, norm_bias, eps, group, None, h, epilogue=epilogue,
                             **launch)
            return Float8Activation(q, scale_inv, x.dtype), h
        # One scale per tensor: the second pass normalises h again, so h is always written.
        h = torch.empty_like(x)
        row_amax = torch.empty(rows, **f32)
        epilogue = ext.Fp8Epilogue(ext.QUANT["row_amax"], code, 0, row_amax.data_ptr())
        cuda.peer_launch(kind, x, bias, residual, weight, norm_bias, eps, group, None, h, epilogue=epilogue, **launch)
        amax = tensor_amax(row_amax, amax_group)
        if rows:
            scale_inv = torch.empty((1, 1), **f32)
            epilogue = ext.Fp8Epilogue(ext.QUANT["tensor"], code, q.data_ptr(), scale_inv.data_ptr(), amax.data_ptr())
            ext.add_norm_fp8(epilogue, h.data_ptr(), 0, 0, cuda.ptr(weight), cuda.ptr(norm_bias), 0, 0, rows, hidden,
                             float(eps), ext.NORMS[norm], ext.DTYPES[dtype_name(x.dtype)],
                             max(1, min(rows, 4 * sm_count())), current_stream())
        else:
            scale_inv = numerics.scales_from_amax(amax, fp8)[1]
        return Float8Activation(q, scale_inv, x.dtype), (h if write_residual else x.new_empty(0))

    return forward


oneshot_forward = _forward("oneshot")
twoshot_forward = _forward("twoshot")
lamport_forward = _forward("lamport")
