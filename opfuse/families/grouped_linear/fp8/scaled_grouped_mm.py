"""``grouped_linear_fp8`` through ``torch._scaled_grouped_mm`` (CUTLASS, sm90): device offsets, no
host sync, CUDA-graph capturable.

torch's grouped FP8 GEMM takes E4M3 operands with per-row float32 scales: ``x`` ``[T, K]`` with
``scale_a [T]``, the weight as ``[G, K, N]`` column-major (the ``[G, N, K]`` bytes transposed) with
``scale_b [G, N]``; K and N multiples of 16. One scale per tensor is passed as that scale on every
row. Rows past the last offset are left unwritten by torch and zeroed here. The weight gradient
("2d x 2d": both operands ragged along the tokens) runs on E4M3 with ``recipe.fp8_wgrad``, its
operands transposed into the padded token layout by
:func:`~opfuse.families.quantize.kernels.quantize_group_columns`, else in bfloat16
(``torch._grouped_mm``); an expert without tokens gets zeros either way (the Triton fix-ups of
:mod:`..torch_mm`: programs of rows and experts that hold data exit at once).

With one scale per expert, the weight is quantized into both operands at once, ``W`` for the
forward and ``W.T`` for the data gradient (:func:`~opfuse.families.quantize.kernels.quantize_stack`:
an amax pass and one cast writing both layouts; with power-of-two scales
:func:`~opfuse.families.quantize.weight_pow2.quantize_stack`, one read), once per weight version, and the forward hands
``W.T`` to its backward with the activation they share (``weight_cache.keep_for_backward``):
Inductor passes a fresh alias of the weight on every call, whose version says nothing.
"""

from __future__ import annotations

import torch

from ....fp8 import grouped as fp8_grouped
from ....fp8.numerics import Quantized
from ....fp8.recipe import recipe_from_key
from ....ops.base import dtype_name
from ...quantize import kernels, weight_cache, weight_pow2
from ..torch_mm import device_offsets as offsets  # the same cumulative, clamped int32 offsets
from ..torch_mm import zero_empty_groups, zero_tail_rows
from ..triton_impl import triton_status
from . import common

__all__ = ["check", "forward", "backward", "offsets"]

_MAX_GROUPS = 1023
_KEPT = "/grouped-wt-for-backward"  # + the recipe key: the forward's W.T kept for its backward


def check(spec) -> str | None:
    if spec.device.type != "cuda":
        return "needs a CUDA device"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    major, minor = torch.cuda.get_device_capability(spec.device)
    if major != 9:
        return f"compute capability {major}.{minor}: torch's grouped FP8 GEMM is tested on sm90 here"
    w = spec.inputs["weight"]
    if spec.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        return f"dtype {dtype_name(spec.dtype)}: the grouped FP8 GEMM writes bfloat16 (and its gradients are bfloat16)"
    groups, n, k = w.shape
    if k % 16 or n % 16:
        return f"in_features {k} / out_features {n} must be multiples of 16"
    if groups > _MAX_GROUPS:
        return f"{groups} groups (at most {_MAX_GROUPS})"
    if spec.requires_grad and not hasattr(torch, "_grouped_mm"):
        return "training needs torch._grouped_mm for the weight gradient"
    reason = triton_status()
    if reason:
        return f"needs triton for its quantizers and tail/empty-group fix-ups: {reason}"
    return None


def _both_weights(weight, r) -> tuple[Quantized, Quantized]:
    """``(W, W.T)`` with one scale per expert, made together once per weight version (with
    power-of-two scales in one read of the weight: the exponents of its previous version as hints,
    keyed by its storage)."""
    def build():
        groups, n, k = weight.shape
        if r.pow2_weight_scales:
            key = ("grouped", weight.data_ptr(), tuple(weight.shape))
            data, data_t, scale_inv = weight_pow2.quantize_stack(weight, r.forward_dtype, key)
        else:
            data, data_t, scale_inv = kernels.quantize_stack(weight, r.forward_dtype)
        return (Quantized(data, scale_inv.unsqueeze(1).expand(groups, n).contiguous()),
                Quantized(data_t, scale_inv.unsqueeze(1).expand(groups, k).contiguous()))

    return weight_cache.cached(weight, f"{r.key()}/grouped-w+wt", build)


def _weight(weight, fsdp_group, num_groups, r) -> Quantized:
    if fsdp_group:  # shards change on every rank: no cache
        return common.weight_operand(weight, fsdp_group, num_groups, r)
    if not r.rowwise:
        return _both_weights(weight, r)[0]

    def build():
        groups, n, k = weight.shape
        q = kernels.quantize(weight.reshape(groups * n, k), r.forward_dtype, True)
        return Quantized(q.data.view(groups, n, k), q.scale_inv.view(groups, n))

    return weight_cache.cached(weight, f"{r.key()}/grouped-w", build)


def _weight_t(weight, fsdp_group, num_groups, r) -> Quantized:
    if fsdp_group:
        return common.weight_t_operand(weight, fsdp_group, num_groups, r)
    if not r.rowwise:
        return _both_weights(weight, r)[1]

    def build():  # per-row scales of W.T: quantized along N, from the high-precision weight
        groups, n, k = weight.shape
        q = kernels.quantize(weight.transpose(1, 2).reshape(groups * k, n), r.forward_dtype, True)
        return Quantized(q.data.view(groups, k, n), q.scale_inv.view(groups, k))

    return weight_cache.cached(weight, f"{r.key()}/grouped-wt", build)


def _group_of_row(offs: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each row's group, ``G`` for rows past the last offset."""
    return torch.searchsorted(offs, torch.arange(tokens, device=offs.device, dtype=torch.int32), right=True)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def forward(x, group_sizes, weight, bias, fsdp_group, num_groups, recipe):
    r = recipe_from_key(recipe)
    tokens = x.shape[0]
    if fsdp_group or r.rowwise:
        wq = _weight(weight, fsdp_group, num_groups, r)
    else:
        wq, wt = _both_weights(weight, r)
        weight_cache.keep_for_backward(x, weight, recipe + _KEPT, wt)
    n = wq.data.shape[1]
    if tokens == 0:
        return x.new_zeros(0, n)
    valid = None if r.rowwise else fp8_grouped.valid_rows(group_sizes, tokens)
    xq = kernels.quantize(x, r.forward_dtype, r.rowwise, valid_rows=valid)
    offs = offsets(group_sizes, tokens)
    y = torch._scaled_grouped_mm(_aligned(xq.data), wq.data.transpose(-2, -1),
                                 xq.scale_inv.reshape(-1).expand(tokens).contiguous(), wq.scale_inv, offs=offs,
                                 out_dtype=x.dtype)
    zero_tail_rows(y, group_sizes)
    full_bias = common.full_bias(bias, fsdp_group, num_groups)
    if full_bias is not None:
        padded = torch.cat([full_bias, full_bias.new_zeros(1, n)])
        y += padded[_group_of_row(offs, tokens)]
    return y


def backward(dy, x, group_sizes, weight, bias, fsdp_group, num_groups, recipe, need_dx, need_dw, need_db):
    r = recipe_from_key(recipe)
    groups, n, k = common.shape_of(weight, fsdp_group, num_groups)
    tokens = dy.shape[0]
    empty = dy.new_empty(0)
    if tokens == 0:
        dx = torch.zeros_like(x) if need_dx else empty
        dw = dy.new_zeros(groups, n, k) if need_dw else empty
        db = dy.new_zeros(groups, n) if need_db else empty
        return (dx, *common.reduce_grads(dw, db, fsdp_group, need_dw, need_db, k))
    dx, dw, db = empty, empty, empty
    offs = offsets(group_sizes, tokens)
    if need_dx:
        wt = weight_cache.take_for_backward(x, weight, recipe + _KEPT)
        if wt is None:
            wt = _weight_t(weight, fsdp_group, num_groups, r)
        dyq = kernels.quantize(dy, torch.float8_e4m3fn, True)
        dx = torch._scaled_grouped_mm(_aligned(dyq.data), wt.data.transpose(-2, -1), dyq.scale_inv.reshape(-1),
                                      wt.scale_inv, offs=offs, out_dtype=dy.dtype)
        zero_tail_rows(dx, group_sizes)
    if need_dw and r.fp8_wgrad:  # dW_g = dy_g.T @ x_g on E4M3, both read along the padded tokens
        layout = fp8_grouped.padded_group_ends(group_sizes, tokens, ends=offs)
        dyt = kernels.quantize_group_columns(dy, group_sizes, layout)
        xt = kernels.quantize_group_columns(x, group_sizes, layout)
        dw = torch._scaled_grouped_mm(dyt.data, xt.data.t(), dyt.scale_inv.reshape(-1), xt.scale_inv.reshape(-1),
                                      offs=layout[1], out_dtype=dy.dtype)
        zero_empty_groups(dw, group_sizes, tokens)
    elif need_dw:
        dw = torch._grouped_mm(_aligned(dy).t(), _aligned(x), offs=offs)
        zero_empty_groups(dw, group_sizes, tokens)
    if need_db:
        rows = _group_of_row(offs, tokens)
        db = torch.zeros(groups + 1, n, dtype=torch.float32, device=dy.device).index_add_(0, rows, dy.float())
        db = db[:groups].to(dy.dtype)
    dw, db = common.reduce_grads(dw, db, fsdp_group, need_dw, need_db, k)
    return dx, dw, db
