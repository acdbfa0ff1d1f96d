"""The FP8 linear layer as math: which quantized operand each GEMM of ``y = x @ W.T + b`` and of
its backward takes, and the float32 emulation of those GEMMs (the reference every FP8 linear
implementation is tested against, and what runs on CPU).

=========  ================================  ========================  ==========================
GEMM       computes                          A operand (rows x K)      B operand (cols x K)
=========  ================================  ========================  ==========================
forward    ``y [M, N] = x @ W.T``            x, E4M3                   W, E4M3
dgrad      ``dx [M, K] = dy @ W``            dy, grad format           W.T, E4M3
wgrad      ``dW [N, K] = dy.T @ x``          dy.T, grad format         x.T, E4M3
=========  ================================  ========================  ==========================

Every operand is scaled along its contracting dim: with one scale per tensor a transposed operand
is the same bytes transposed; with one per row it is quantized again along its new rows (W.T from
the high-precision weight; x.T and dy.T from the dequantized x and dy operands, the only copies
that are kept, and the only ones a collective has to move).
"""

from __future__ import annotations

import torch

from .numerics import Quantized, quantize
from .recipe import Recipe
from .tensor import payload

__all__ = ["compute_dtype", "input_operand", "weight_operand", "grad_operand", "weight_t_operand",
           "grad_t_operand", "input_t_operand", "emulated_forward", "emulated_backward", "fp8_linear"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 (float64 for float64 blocks): the emulation's arithmetic."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rows2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def input_operand(x: torch.Tensor, recipe: Recipe) -> Quantized:
    """x as the forward A operand: its payload when it is already FP8, else quantized here."""
    q = payload(x)
    if q is not None:
        return q
    return quantize(rows2d(x), recipe.forward_dtype, recipe.rowwise)


def weight_operand(weight: torch.Tensor, recipe: Recipe) -> Quantized:
    return quantize(weight, recipe.forward_dtype, recipe.rowwise, pow2=recipe.pow2_weight_scales)


def grad_operand(dy2d: torch.Tensor, recipe: Recipe) -> Quantized:
    return quantize(dy2d, recipe.grad_dtype, recipe.rowwise)


def weight_t_operand(weight: torch.Tensor, wq: Quantized | None, recipe: Recipe) -> Quantized:
    """W.T ``[K, N]`` for dgrad."""
    if not recipe.rowwise and wq is not None:
        return wq.t()
    return quantize(weight.t(), recipe.forward_dtype, recipe.rowwise, pow2=recipe.pow2_weight_scales)


def grad_t_operand(dyq: Quantized, recipe: Recipe) -> Quantized:
    """dy.T ``[N, M]`` for wgrad: the bytes transposed (one scale), else quantized again along its
    rows from the dequantized dy (so that only the quantized dy need be kept or gathered)."""
    if not recipe.rowwise and dyq.scale_inv.numel() == 1:
        return dyq.t()
    return quantize(dyq.dequantize().t(), recipe.grad_dtype, recipe.rowwise)


def input_t_operand(xq: Quantized, recipe: Recipe) -> Quantized:
    """x.T ``[K, M]`` for wgrad: the bytes transposed when x has one scale, else quantized again
    (per recipe) from the dequantized x (per-row scales of x do not follow the transpose)."""
    if not recipe.rowwise and xq.scale_inv.numel() == 1:
        return xq.t()
    return quantize(xq.dequantize().t(), recipe.forward_dtype, recipe.rowwise)


def emulated_forward(xq: Quantized, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """``y [M, N]`` (``out_dtype``) from the quantized input, in float32."""
    ct = compute_dtype(out_dtype)
    y = xq.dequantize(ct) @ weight_operand(weight, recipe).dequantize(ct).t()
    if bias is not None:
        y = y + bias.to(ct)
    return y.to(out_dtype)


def emulated_backward(dy2d: torch.Tensor, xq: Quantized, weight: torch.Tensor, recipe: Recipe, need_dx: bool,
                      need_dw: bool, need_db: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx [M, K], dW [N, K], db [N])`` (empty when not needed) in the dtypes of dy and W."""
    ct = compute_dtype(dy2d.dtype)
    empty = dy2d.new_empty(0)
    dx = dw = db = empty
    dyq = grad_operand(dy2d, recipe) if (need_dx or (need_dw and recipe.fp8_wgrad)) else None
    if need_dx:
        wt = weight_t_operand(weight, None, recipe)
        dx = (dyq.dequantize(ct) @ wt.dequantize(ct).t()).to(dy2d.dtype)
    if need_dw:
        if recipe.fp8_wgrad:
            a, b = grad_t_operand(dyq, recipe), input_t_operand(xq, recipe)
            dw = a.dequantize(ct) @ b.dequantize(ct).t()
        else:
            dw = dy2d.to(ct).t() @ xq.dequantize(ct)
        dw = dw.to(weight.dtype)
    if need_db:
        db = dy2d.sum(0, dtype=ct).to(dy2d.dtype)
    return dx, dw, db


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe):
        xq = input_operand(x, recipe)
        y = emulated_forward(xq, weight, bias, recipe, x.dtype)
        ctx.save_for_backward(xq.data, xq.scale_inv, weight)
        ctx.recipe, ctx.has_bias, ctx.x_shape = recipe, bias is not None, x.shape
        return y.reshape(tuple(x.shape[:-1]) + (weight.shape[0],))

    @staticmethod
    def backward(ctx, dy):
        data, scale_inv, weight = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx, dw, db = emulated_backward(rows2d(dy), Quantized(data, scale_inv), weight, ctx.recipe, need_dx, need_dw,
                                       need_db and ctx.has_bias)
        return (dx.reshape(ctx.x_shape) if need_dx else None, dw if need_dw else None,
                db if need_db and ctx.has_bias else None, None)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Recipe) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with FP8 operands (forward, data and weight gradients), emulated
    in float32: the reference of ``BasicLinear`` under :func:`opfuse.fp8.autocast`."""
    return _Fp8LinearFn.apply(x, weight, bias, recipe)
