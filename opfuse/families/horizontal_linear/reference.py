"""Reference implementation of ``horizontal_linear``: one GEMM over the joined weight, after an
all-gather of the tokens for the sequence-parallel form (``group`` set)."""

from __future__ import annotations

import torch.nn.functional as F

from ...ops.norm import compute_dtype
from ..collective_linear import reference as collective_reference

__all__ = ["forward", "backward"]


def forward(x, weight, bias, group):
    if group is not None:
        return collective_reference.ag_linear_forward(x, weight, bias, group)
    return F.linear(x, weight, bias)


def backward(dy, x, weight, group, need_dx, need_dw, need_db):
    if group is not None:
        return collective_reference.ag_linear_backward(dy, x, weight, group, need_dx, need_dw, need_db)
    rows = dy.reshape(-1, dy.shape[-1])
    dx = F.linear(dy, weight.t()) if need_dx else dy.new_empty(0)
    dw = rows.t().mm(x.reshape(-1, x.shape[-1])) if need_dw else dy.new_empty(0)
    db = rows.sum(0, dtype=compute_dtype(dy.dtype)).to(dy.dtype) if need_db else dy.new_empty(0)
    return dx, dw, db
