"""The reference implementation of ``grouped_linear``: a loop of matmuls over host group sizes.

Runs on any device and dtype (float64 included). It reads ``group_sizes`` on the host, so on a
GPU it synchronises; it is the always-capable last entry of the implementation list and the baseline the
kernels are tested against. Products accumulate in float32 (float64 for float64), as the kernels do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...ops.norm import compute_dtype

__all__ = ["reference_forward", "reference_backward", "host_bounds"]


def host_bounds(group_sizes: Tensor, tokens: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` row range per group, read on the host; ``ValueError`` for negative
    sizes or a sum above ``tokens``."""
    counts = [int(c) for c in group_sizes.tolist()]
    if any(c < 0 for c in counts) or sum(counts) > tokens:
        raise ValueError(f"grouped_linear: group_sizes {counts} must be non-negative and sum to at most the "
                         f"{tokens} rows of x")
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


def reference_forward(x: Tensor, group_sizes: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``y [T, N]`` for ``x [T, K]``, ``weight [G, N, K]``, ``bias [G, N]``; zero tail rows."""
    ct = compute_dtype(x.dtype)
    y = x.new_zeros(x.shape[0], weight.shape[1])
    for g, (start, end) in enumerate(host_bounds(group_sizes, x.shape[0])):
        if end > start:
            rows = x[start:end].to(ct) @ weight[g].to(ct).t()
            if bias is not None:
                rows = rows + bias[g].to(ct)
            y[start:end] = rows.to(x.dtype)
    return y


def reference_backward(dy: Tensor, x: Tensor, group_sizes: Tensor, weight: Tensor, *, need_dx: bool,
                       need_dw: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dw, db)``; an output not asked for is an empty tensor. Groups without tokens get
    zero ``dw``/``db``; tail rows get zero ``dx``."""
    ct = compute_dtype(dy.dtype)
    groups, out_features = weight.shape[0], weight.shape[1]
    dx = torch.zeros_like(x) if need_dx else dy.new_empty(0)
    dw = weight.new_zeros(weight.shape) if need_dw else dy.new_empty(0)  # weight may be a shape-only stand-in
    db = dy.new_zeros(groups, out_features) if need_db else dy.new_empty(0)
    for g, (start, end) in enumerate(host_bounds(group_sizes, x.shape[0])):
        if end == start:
            continue
        dy_g = dy[start:end].to(ct)
        if need_dx:
            dx[start:end] = (dy_g @ weight[g].to(ct)).to(dx.dtype)
        if need_dw:
            dw[g] = (dy_g.t() @ x[start:end].to(ct)).to(dw.dtype)
        if need_db:
            db[g] = dy_g.sum(0).to(db.dtype)
    return dx, dw, db
