"""The quantization math, in plain torch ops: the definition every FP8 kernel is tested against,
and the float32 emulation the CPU reference runs.

A quantized operand is ``(data, scale_inv)``: ``data`` in an FP8 format, ``scale_inv`` float32
of shape ``[1, 1]`` (one scale per tensor) or ``[rows, 1]`` (one per row), so that
``dequantize = data.float() * scale_inv`` (``torch._scaled_mm``'s ``scale_a`` / ``scale_b`` are
these dequantization factors). Quantizing::

    amax      = max |x|                      (over the tensor, or over each row)
    scale     = fp8_max / amax               (1 where amax is 0: an all-zero tensor stays zero)
    data      = saturate(x.float() * scale)  (round to nearest even, clamped to +-fp8_max)
    scale_inv = 1 / scale

Operands are 2-D with the contracting dim last (``[rows, K]``); a GEMM ``a @ b.T`` takes ``a``
``[M, K]`` and ``b`` ``[N, K]``, each scaled along K.
"""

from __future__ import annotations

import typing

import torch

from .recipe import FP8_DTYPES

__all__ = ["Quantized", "fp8_max", "amax", "scales_from_amax", "cast", "quantize", "quantize_stack", "dequantize",
           "emulated_mm", "row_mask", "POW2_EXPONENTS", "pow2_exponent", "pow2_scales", "pow2_scales_from_amax"]


class Quantized(typing.NamedTuple):
    """An FP8 operand: ``data`` ``[rows, K]`` and float32 ``scale_inv`` ``[1, 1]`` or ``[rows, 1]``."""

    data: torch.Tensor
    scale_inv: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.data, self.scale_inv, dtype)

    def t(self) -> "Quantized":
        """The transposed operand (same scale; only valid for one scale per tensor)."""
        if self.scale_inv.numel() != 1:
            raise ValueError("Quantized.t(): a per-row scale does not follow a transpose; quantize the transposed "
                             "operand instead")
        return Quantized(self.data.t().contiguous(), self.scale_inv)


def fp8_max(dtype: torch.dtype) -> float:
    try:
        return FP8_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"opfuse.fp8: {dtype} is not an FP8 format; accepted: {list(FP8_DTYPES)}") from None


def row_mask(rows: int, valid: torch.Tensor | None, device) -> torch.Tensor | None:
    """``[rows, 1]`` bool: row index < ``valid`` (a device scalar), or ``None`` without ``valid``."""
    if valid is None:
        return None
    return (torch.arange(rows, device=device) < valid).unsqueeze(1)


def amax(x: torch.Tensor, rowwise: bool, valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[rows, 1]`` (per row) or ``[1, 1]`` of ``max |x|`` for 2-D ``x``; rows at or
    past ``valid_rows`` (a device scalar) count as zero (a static buffer's unused tail)."""
    rows = x.shape[0]
    if x.numel() == 0:
        return torch.zeros((rows if rowwise else 1, 1), dtype=torch.float32, device=x.device)
    mask = row_mask(rows, valid_rows, x.device)
    if mask is not None:
        x = x.masked_fill(~mask, 0)
    # The infinity norm is max |x| without an |x| temporary.
    if rowwise:
        return torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True).float()
    return torch.linalg.vector_norm(x, float("inf")).float().reshape(1, 1)


def scales_from_amax(a: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, scale_inv)`` (float32) for amax ``a``: ``fp8_max / a``, 1 where ``a`` is 0."""
    a = a.float()
    # Tensor / tensor divisions (IEEE, correctly rounded): ``scalar / tensor`` would multiply by
    # a reciprocal, one rounding more, and the kernels could not reproduce it.
    one = torch.ones_like(a)
    scale = torch.where(a > 0, torch.full_like(a, fp8_max(dtype)) / a, one)
    return scale, one / scale


#: The exponents a power-of-two scale may take: its reciprocal stays a normal float32.
POW2_EXPONENTS = (-126, 126)


def pow2_exponent(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int32 ``floor(log2(fp8_max / a))`` for amax ``a``, read off the exponent bits of the
    float32 quotient (correctly rounded, as the kernels compute it), clamped to
    :data:`POW2_EXPONENTS`; 0 where ``a`` is 0 (or NaN)."""
    a = a.float()
    ratio = torch.full_like(a, fp8_max(dtype)) / a
    exponent = ((ratio.view(torch.int32) >> 23) & 0xFF) - 127
    exponent = exponent.clamp(*POW2_EXPONENTS)
    return torch.where(a > 0, exponent, torch.zeros_like(exponent))


def pow2_scales(exponent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2**e, 2**-e)`` (float32, exact) for int32 exponents ``e``."""
    return (((exponent + 127) << 23).view(torch.float32), ((127 - exponent) << 23).view(torch.float32))


def pow2_scales_from_amax(a: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, scale_inv)``: ``fp8_max / a`` rounded down to a power of two (1 where ``a`` is 0).
    ``|x| * scale <= fp8_max`` still holds for every ``|x| <= a``, so nothing saturates."""
    return pow2_scales(pow2_exponent(a, dtype))


def cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x * scale)`` in ``dtype`` (``scale`` broadcasts over the rows)."""
    limit = fp8_max(dtype)
    return (x.float() * scale).clamp_(-limit, limit).to(dtype)


def quantize(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, amax_value: torch.Tensor | None = None,
             valid_rows: torch.Tensor | None = None, pow2: bool = False) -> Quantized:
    """Quantize 2-D ``x`` along its last dim (module docstring). ``amax_value`` overrides the
    amax (e.g. one all-reduced over a process group); ``pow2`` rounds the scales down to powers
    of two (:func:`pow2_scales_from_amax`)."""
    if x.dim() != 2:
        raise ValueError(f"opfuse.fp8.quantize: expected a 2-D operand, got shape {list(x.shape)}")
    a = amax(x, rowwise, valid_rows) if amax_value is None else amax_value
    scale, scale_inv = (pow2_scales_from_amax if pow2 else scales_from_amax)(a, dtype)
    return Quantized(cast(x, scale, dtype), scale_inv)


def quantize_stack(w: torch.Tensor, dtype: torch.dtype, pow2: bool = False):
    """Each matrix of ``w [G, R, C]`` (a grouped GEMM's experts) quantized with one scale of its own
    (rounded down to a power of two with ``pow2``): ``(data [G, R, C], data_t [G, C, R],
    scale_inv [G])``."""
    groups, rows, cols = w.shape
    amaxes = torch.linalg.vector_norm(w.reshape(groups, -1).float(), float("inf"), dim=1)
    q = quantize(w.reshape(groups * rows, cols), dtype, True, amaxes.repeat_interleave(rows).reshape(-1, 1), pow2=pow2)
    data = q.data.view(groups, rows, cols)
    return data, data.transpose(1, 2).contiguous(), q.scale_inv.view(groups, rows)[:, 0].contiguous()


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale_inv`` (computed in float32, or float64 when ``dtype`` is float64)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (data.to(compute) * scale_inv.to(compute)).to(dtype)


def emulated_mm(a: Quantized, b: Quantized, compute: torch.dtype = torch.float32) -> torch.Tensor:
    """``dequantize(a) @ dequantize(b).T`` in ``compute`` (float32: the FP8 GEMM's products are
    exact in float32 and its accumulation is float32)."""
    return a.dequantize(compute) @ b.dequantize(compute).t()
