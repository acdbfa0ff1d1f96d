"""The FP8 grouped GEMM of ``GroupedLinear`` (mixture of experts) as math: its quantized operands
and their float32 emulation.

Operands (``x [T, K]`` sorted by group, ``weight [G, N, K]``, rows past ``sum(group_sizes)``
unused):

=========  =============================  ==============================  =====================
GEMM       computes                       A operand, scales               B operand, scales
=========  =============================  ==============================  =====================
forward    ``y_g = x_g @ W_g.T``          x, E4M3, ``[T]``                W, E4M3, ``[G, N]``
dgrad      ``dx_g = dy_g @ W_g``          dy, E4M3 per row, ``[T]``       W.T, E4M3, ``[G, K]`` (*)
wgrad (**) ``dW_g = dy_g.T @ x_g``        dy.T, E4M3, ``[G, N]``          x, E4M3, ``[G, K]``
=========  =============================  ==============================  =====================

(*) One scale per expert: W's bytes transposed. One per row: W.T quantized along N from the
high-precision weight (under FSDP the backward gathers the weight shards in their dtype).

(**) With ``recipe.fp8_wgrad`` (else float32 accumulation of the high-precision operands, rounded
to the parameter dtype). The weight gradient contracts over each expert's ragged token range, so
its operands are scaled per expert and feature: ``dy_g``'s column ``n`` (and ``x_g``'s column
``k``) gets the scale of its amax over the expert's tokens (:func:`group_columns_operand`). The
GEMM reads both operands along the tokens (FP8 tensor cores take K-major operands only), so they
are stored transposed, ``[N, T_pad]`` and ``[K, T_pad]``, each expert's tokens starting on a
multiple of :data:`TOKEN_ALIGN` (the 16-byte alignment the GEMM's tiles load from) with zeros in
between (:func:`padded_group_ends`).

The gradient operands are E4M3 whatever the recipe: torch's grouped FP8 GEMM takes E4M3 operands
only, and per-token (dgrad) or per-expert-and-feature (wgrad) scales give E4M3 the range
gradients need.

Scales are stored per row of each operand (what ``torch._scaled_grouped_mm`` takes): one scale per
tensor is that scale on every row (x: one for all tokens, the unused tail excluded from the amax;
W: one per expert), one per row is each row's own. The weight is quantized as the rows of its
``[G * N, K]`` view, so that FSDP shards (contiguous rows) quantize independently and gather as FP8:
with one scale per expert, the experts' amax is all-reduced over the FSDP group first.
"""

from __future__ import annotations

import torch

from .numerics import Quantized, amax, cast, pow2_scales_from_amax, quantize, scales_from_amax
from .recipe import Recipe

__all__ = ["valid_rows", "input_operand", "weight_rows_operand", "weight_t_operand", "grad_operand",
           "TOKEN_ALIGN", "padded_group_ends", "group_columns_operand", "host_bounds", "emulated_forward",
           "emulated_backward"]

#: Each expert's first token in the weight gradient's FP8 operands sits on a multiple of this.
TOKEN_ALIGN = 16


def valid_rows(group_sizes: torch.Tensor, tokens: int) -> torch.Tensor:
    """``min(sum(max(group_sizes, 0)), tokens)`` on the device (no host sync)."""
    return group_sizes.clamp(min=0).sum().clamp(max=tokens)


def input_operand(x: torch.Tensor, group_sizes: torch.Tensor, recipe: Recipe, dtype=None) -> Quantized:
    """x (or dy with ``dtype``) quantized along its rows: ``scale_inv`` is ``[T]``."""
    dtype = dtype or recipe.forward_dtype
    q = quantize(x, dtype, recipe.rowwise, valid_rows=None if recipe.rowwise else valid_rows(group_sizes, x.shape[0]))
    return Quantized(q.data, q.scale_inv.reshape(-1).expand(x.shape[0]).contiguous())


def grad_operand(dy: torch.Tensor) -> Quantized:
    """dy for dgrad: E4M3, one scale per row (``scale_inv [T]``; see the module docstring)."""
    q = quantize(dy, torch.float8_e4m3fn, True)
    return Quantized(q.data, q.scale_inv.reshape(-1))


def weight_rows_operand(rows: torch.Tensor, first_row: int, out_features: int, num_groups: int, recipe: Recipe,
                        reduce_amax=None) -> Quantized:
    """Rows ``[first_row, first_row + R)`` of the ``[G * N, K]`` weight view, quantized: ``data [R, K]``,
    ``scale_inv [R]``. With one scale per expert, ``reduce_amax(amax [G])`` (an all-reduce MAX over
    the ranks holding the other rows) completes each expert's amax."""
    if recipe.rowwise:
        q = quantize(rows, recipe.forward_dtype, True)
        return Quantized(q.data, q.scale_inv.reshape(-1))
    row_amax = amax(rows, True).reshape(-1)
    group_of_row = (torch.arange(rows.shape[0], device=rows.device) + first_row) // out_features
    per_group = torch.zeros(num_groups, dtype=torch.float32, device=rows.device)
    per_group = per_group.scatter_reduce(0, group_of_row, row_amax, reduce="amax", include_self=True)
    if reduce_amax is not None:
        reduce_amax(per_group)
    scale, scale_inv = (pow2_scales_from_amax if recipe.pow2_weight_scales else scales_from_amax)(
        per_group, recipe.forward_dtype)
    data = cast(rows, scale[group_of_row].unsqueeze(1), recipe.forward_dtype)
    return Quantized(data, scale_inv[group_of_row])


def weight_t_operand(wq: Quantized | None, recipe: Recipe, weight: torch.Tensor | None = None) -> Quantized:
    """W.T per expert (``data [G, K, N]``, ``scale_inv [G, K]``): with one scale per expert, the forward
    operand's bytes transposed (``wq``: ``data [G, N, K]``, ``scale_inv [G, N]``); with one per row,
    the high-precision ``weight [G, N, K]`` quantized along N."""
    if not recipe.rowwise:
        groups, _, k = wq.data.shape
        return Quantized(wq.data.transpose(1, 2).contiguous(), wq.scale_inv[:, :1].expand(groups, k).contiguous())
    groups, n, k = weight.shape
    q = quantize(weight.transpose(1, 2).reshape(groups * k, n), recipe.forward_dtype, True)
    return Quantized(q.data.view(groups, k, n), q.scale_inv.view(groups, k))


def padded_group_ends(group_sizes: torch.Tensor, tokens: int,
                      ends: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(ends, padded_ends, padded_tokens)``: each group's cumulative end row in ``[0, tokens]``
    (int32, clamped like the kernels; pass them as ``ends`` when already made), its end in the
    padded layout of the weight gradient's operands (each group's size rounded up to
    :data:`TOKEN_ALIGN`; int32) and that layout's length, a multiple of :data:`TOKEN_ALIGN` large
    enough for any sizes (no host sync)."""
    if ends is None:
        ends = torch.cumsum(group_sizes.clamp(min=0), 0, dtype=torch.int64).clamp_(max=tokens).to(torch.int32)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = torch.cumsum((sizes + TOKEN_ALIGN - 1) // TOKEN_ALIGN * TOKEN_ALIGN, 0)
    groups = group_sizes.shape[0]
    padded_tokens = -(-(tokens + (TOKEN_ALIGN - 1) * groups) // TOKEN_ALIGN) * TOKEN_ALIGN
    return ends, padded.to(torch.int32), padded_tokens


def group_columns_operand(t: torch.Tensor, group_sizes: torch.Tensor) -> Quantized:
    """``t [T, C]`` as an operand of the FP8 weight gradient: E4M3 ``data [C, padded_tokens]`` (group
    ``g``'s rows at ``[padded_ends[g-1], padded_ends[g-1] + size_g)``, zeros elsewhere; see
    :func:`padded_group_ends`) and ``scale_inv [G, C]``, one scale per group and column from that
    column's amax over the group's rows (reference: a loop over the host group sizes)."""
    tokens, cols = t.shape
    groups = group_sizes.shape[0]
    _, padded_ends, padded_tokens = padded_group_ends(group_sizes, tokens)
    data = torch.zeros(cols, padded_tokens, dtype=torch.float8_e4m3fn, device=t.device)
    scale_inv = torch.ones(groups, cols, dtype=torch.float32, device=t.device)
    starts = [0] + padded_ends.tolist()[:-1]
    for g, (start, end) in enumerate(host_bounds(group_sizes, tokens)):
        if end > start:
            q = quantize(t[start:end].t().contiguous(), torch.float8_e4m3fn, True)
            data[:, starts[g]:starts[g] + end - start] = q.data
            scale_inv[g] = q.scale_inv.reshape(-1)
    return Quantized(data, scale_inv)


def host_bounds(group_sizes: torch.Tensor, tokens: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` per group, clamped to ``tokens`` like the kernels (reads the sizes on
    the host)."""
    bounds, start = [], 0
    for count in group_sizes.tolist():
        end = min(start + max(int(count), 0), tokens)
        bounds.append((start, end))
        start = end
    return bounds


def _rows(q: Quantized, start: int, end: int, ct) -> torch.Tensor:
    return q.data[start:end].to(ct) * q.scale_inv[start:end].to(ct).unsqueeze(1)


def emulated_forward(xq: Quantized, group_sizes: torch.Tensor, wq: Quantized, bias: torch.Tensor | None,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """``y [T, N]`` from ``xq`` (``[T, K]``, scales ``[T]``) and ``wq`` (``[G, N, K]``, ``[G, N]``);
    zero tail rows."""
    ct = torch.float64 if out_dtype == torch.float64 else torch.float32
    tokens, n = xq.data.shape[0], wq.data.shape[1]
    y = torch.zeros(tokens, n, dtype=ct, device=xq.data.device)
    for g, (start, end) in enumerate(host_bounds(group_sizes, tokens)):
        if end > start:
            w = wq.data[g].to(ct) * wq.scale_inv[g].to(ct).unsqueeze(1)
            y[start:end] = _rows(xq, start, end, ct) @ w.t()
            if bias is not None:
                y[start:end] += bias[g].to(ct)
    return y.to(out_dtype)


def emulated_backward(dy: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor, wt: Quantized | None,
                      need_dx: bool, need_dw: bool, need_db: bool, shape, fp8_wgrad: bool = False) -> tuple:
    """``(dx [T, K], dW [G, N, K], db [G, N])`` (empty when not needed): dx from FP8 operands (``wt``:
    :func:`weight_t_operand`), dW from FP8 operands with ``fp8_wgrad`` (:func:`group_columns_operand`)
    else from ``dy`` and ``x``, db from ``dy``; float32 sums rounded to ``dy``'s dtype.
    ``shape`` = ``(G, N, K)``."""
    ct = torch.float64 if dy.dtype == torch.float64 else torch.float32
    groups, n, k = shape
    tokens = dy.shape[0]
    empty = dy.new_empty(0)
    dx = torch.zeros(tokens, k, dtype=ct, device=dy.device) if need_dx else empty
    dw = torch.zeros(groups, n, k, dtype=ct, device=dy.device) if need_dw else empty
    db = torch.zeros(groups, n, dtype=ct, device=dy.device) if need_db else empty
    if need_dx:
        dyq = grad_operand(dy)
    for g, (start, end) in enumerate(host_bounds(group_sizes, tokens)):
        if end == start:
            continue
        if need_dx:
            w = wt.data[g].to(ct) * wt.scale_inv[g].to(ct).unsqueeze(1)
            dx[start:end] = _rows(dyq, start, end, ct) @ w.t()
        if need_dw and fp8_wgrad:  # the group's columns of group_columns_operand: rows of the transposes
            dyt, xt = (quantize(t[start:end].t().contiguous(), torch.float8_e4m3fn, True) for t in (dy, x))
            dw[g] = dyt.dequantize(ct) @ xt.dequantize(ct).t()
        elif need_dw:
            dw[g] = dy[start:end].to(ct).t() @ x[start:end].to(ct)
        if need_db:
            db[g] = dy[start:end].to(ct).sum(0)
    return (dx.to(dy.dtype) if need_dx else empty, dw.to(dy.dtype) if need_dw else empty,
            db.to(dy.dtype) if need_db else empty)
