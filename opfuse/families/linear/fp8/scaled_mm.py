"""``fp8_linear`` through ``torch._scaled_mm`` (cuBLASLt FP8 GEMMs for one scale per tensor, CUTLASS
for per-row scales), forward and backward.

Layout rules of ``torch._scaled_mm(a, b, scale_a, scale_b)``: ``a`` row-major ``[M, K]``, ``b``
column-major ``[K, N]`` (a row-major ``[N, K]`` tensor transposed: the operands of
:mod:`opfuse.fp8.linear` are stored with their contracting dim last, so every B operand is
``rows.t()``), K and N multiples of 16, float32 scales: one element each, or ``[M, 1]`` and
``[1, N]`` (both per row; sm90, bfloat16 output). The weight-gradient GEMM contracts over the
tokens: a token count that is not a multiple of 16 is padded with zero columns.

Weights are quantized once per parameter version (:mod:`...quantize.weight_cache`); activations
and gradients by the Triton quantizers (:mod:`...quantize.kernels`). GEMMs accumulate in float32
(no fast accumulation), so results match the float32 emulation to float32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ....fp8.numerics import Quantized
from ....fp8.recipe import recipe_from_key
from ....fp8.state import weight_trained
from ....ops.base import dtype_name
from ...quantize import kernels, weight_cache, weight_pow2
from .reference import reshape_out, transposes_x

__all__ = ["check", "forward", "backward", "scaled_mm", "weight_operand", "weight_t_operand", "pad_tokens",
           "grad_operands", "backward_gemms", "quantize_input", "NAME"]

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NAME = "scaled_mm"


def check(spec) -> str | None:
    if spec.device.type != "cuda":
        return "needs a CUDA device"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    major, minor = torch.cuda.get_device_capability(spec.device)
    if (major, minor) < (8, 9):
        return f"compute capability {major}.{minor}: FP8 GEMMs need sm89 or newer"
    x, w, b = spec.x, spec.inputs["weight"], spec.inputs.get("bias")
    rowwise = spec.attrs["recipe"].rowwise or (x.quantized or "").endswith("/row")
    if x.dtype not in _OUT_DTYPES or w.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
        return f"dtypes x {dtype_name(x.dtype)} / weight {dtype_name(w.dtype)}: both bfloat16, float16 or float32"
    if rowwise and (major < 9 or x.dtype != torch.bfloat16):
        return "per-row scales: torch's row-wise FP8 GEMM needs sm90 and bfloat16"
    n, k = w.shape
    if k % 16 or n % 16:
        return f"in_features {k} / out_features {n}: torch._scaled_mm needs multiples of 16"
    return None


def _scale_pair(a: Quantized, b: Quantized):
    """``(scale_a, scale_b)`` in the forms torch takes: two scalars, or ``[M, 1]`` and ``[1, N]``."""
    if a.scale_inv.numel() == 1 and b.scale_inv.numel() == 1:
        return a.scale_inv.reshape(()), b.scale_inv.reshape(())
    m, n = a.data.shape[0], b.data.shape[0]
    return (a.scale_inv.reshape(-1, 1).expand(m, 1).contiguous(),
            b.scale_inv.reshape(1, -1).expand(1, n).contiguous())


def scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``dequantize(a) @ dequantize(b).T (+ bias)``: ``a`` ``[M, K]``, ``b`` ``[N, K]`` (rows = output
    columns), float32 accumulation."""
    if a.data.shape[0] == 0 or a.data.shape[1] == 0:
        y = a.data.new_zeros((a.data.shape[0], b.data.shape[0]), dtype=out_dtype)
        return y + bias if bias is not None and y.numel() else y
    sa, sb = _scale_pair(a, b)
    kwargs = {} if out is None else {"out": out}
    return torch._scaled_mm(a.data, b.data.t(), sa, sb, bias=bias, out_dtype=out_dtype, **kwargs)


def _quantize_tensor_scaled(weight: torch.Tensor, recipe, transpose: bool):
    if recipe.pow2_weight_scales:  # one read, the hint keyed by the parameter object
        return weight_pow2.quantize_weight(weight, recipe.forward_dtype, transpose, key=("parameter", id(weight)))
    return kernels.quantize(weight, recipe.forward_dtype, False, transpose=transpose)


def _weight_pair(weight: torch.Tensor, recipe) -> tuple[Quantized, Quantized]:
    """W and W.T with one scale per tensor, written by one pass (training needs both)."""
    return weight_cache.cached(weight, f"{recipe.key()}/w+wt", lambda: _quantize_tensor_scaled(weight, recipe, True))


def weight_operand(weight: torch.Tensor, recipe) -> Quantized:
    if not recipe.rowwise and weight_trained(weight):
        return _weight_pair(weight, recipe)[0]
    if not recipe.rowwise:
        return weight_cache.cached(weight, f"{recipe.key()}/w", lambda: _quantize_tensor_scaled(weight, recipe, False))
    return weight_cache.cached(weight, f"{recipe.key()}/w", lambda: kernels.quantize(weight, recipe.forward_dtype, True))


def weight_t_operand(weight: torch.Tensor, recipe) -> Quantized:
    if not recipe.rowwise:
        return _weight_pair(weight, recipe)[1]
    return weight_cache.cached(weight, f"{recipe.key()}/wt",
                               lambda: kernels.quantize(weight.t().contiguous(), recipe.forward_dtype, True))


def pad_tokens(q: Quantized, multiple: int = 16) -> Quantized:
    """Zero columns up to a multiple of ``multiple`` (the contracting dim of the wgrad GEMM)."""
    cols = q.data.shape[1]
    pad = -cols % multiple
    if not pad:
        return q
    data = F.pad(q.data.view(torch.uint8), (0, pad)).view(q.data.dtype)
    return Quantized(data, q.scale_inv)


def quantize_input(x, x_data, x_scale, weight, r, recipe: str):
    """``(xq, xt)``: x's FP8 operand (the given payload or quantized here) and, when this pass can
    write them (:func:`.reference.transposes_x`), its transposed bytes for the wgrad GEMM (else ``None``)."""
    k = weight.shape[1]
    if x_data is not None:
        return Quantized(x_data.reshape(-1, k), x_scale), None
    if transposes_x(False, weight, recipe, NAME):
        return kernels.quantize(x.reshape(-1, k), r.forward_dtype, False, transpose=True)
    return kernels.quantize(x.reshape(-1, k), r.forward_dtype, r.rowwise), None


def forward(x, x_data, x_scale, weight, bias, recipe):
    r = recipe_from_key(recipe)
    xq, xt = quantize_input(x, x_data, x_scale, weight, r, recipe)
    y = scaled_mm(xq, weight_operand(weight, r), x.dtype, bias)
    return reshape_out(y, x, weight, xq, x_data is not None, xt)


def grad_operands(dy2: torch.Tensor, r, need_dx: bool, need_dw: bool, amax_value=None):
    """``(dyq, dyt)``: dy for dgrad and dy.T for an FP8 wgrad (``None`` where not needed)."""
    fp8_wgrad = need_dw and r.fp8_wgrad
    if not (need_dx or fp8_wgrad):
        return None, None
    if r.rowwise:
        dyq = kernels.quantize(dy2, r.grad_dtype, True)
        return dyq, (grad_t_operand(dyq, r) if fp8_wgrad else None)
    if fp8_wgrad:
        return kernels.quantize(dy2, r.grad_dtype, False, amax_value=amax_value, transpose=True)
    return kernels.quantize(dy2, r.grad_dtype, False, amax_value=amax_value), None


def grad_t_operand(dyq: Quantized, r) -> Quantized:
    """dy.T for wgrad from the quantized dy (:func:`opfuse.fp8.linear.grad_t_operand`)."""
    if not r.rowwise and dyq.scale_inv.numel() == 1:
        return Quantized(dyq.data.t().contiguous(), dyq.scale_inv)
    return kernels.quantize(dyq.dequantize().t().contiguous(), r.grad_dtype, r.rowwise)


def input_t_operand(xq: Quantized, r, data_t: torch.Tensor | None = None) -> Quantized:
    """x.T for wgrad (:func:`opfuse.fp8.linear.input_t_operand`); ``data_t``: the transposed bytes
    written with ``xq`` (one scale per tensor), if any."""
    if data_t is not None and data_t.numel():
        return Quantized(data_t, xq.scale_inv)
    if not r.rowwise and xq.scale_inv.numel() == 1:
        return Quantized(xq.data.t().contiguous(), xq.scale_inv)
    return kernels.quantize(xq.dequantize().t().contiguous(), r.forward_dtype, r.rowwise)


def backward_gemms(dy2, dyq, dyt, xq, weight, r, need_dx: bool, need_dw: bool, x_data_t=None):
    """``(dx, dw)`` from the quantized operands (empty when not needed; a high-precision wgrad
    reads ``dy2``)."""
    empty = dy2.new_empty(0)
    dx = scaled_mm(dyq, weight_t_operand(weight, r), dy2.dtype) if need_dx else empty
    dw = empty
    if need_dw:
        if r.fp8_wgrad:
            dw = scaled_mm(pad_tokens(dyt), pad_tokens(input_t_operand(xq, r, x_data_t)), weight.dtype)
        else:
            dw = dy2.t().mm(xq.dequantize(dy2.dtype))
    return dx, dw


def backward(dy, x_data, x_scale, x_data_t, weight, recipe, need_dx, need_dw, need_db):
    r = recipe_from_key(recipe)
    n, k = weight.shape
    dy2 = dy.reshape(-1, n)
    xq = Quantized(x_data.reshape(-1, k), x_scale)
    dyq, dyt = grad_operands(dy2, r, need_dx, need_dw)
    dx, dw = backward_gemms(dy2, dyq, dyt, xq, weight, r, need_dx, need_dw, x_data_t)
    db = dy2.sum(0, dtype=torch.float32).to(dy.dtype) if need_db else dy.new_empty(0)
    return dx, dw, db
