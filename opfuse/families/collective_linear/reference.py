"""Reference implementations of the collective linear ops: the collective, then one GEMM (or the
GEMM, then the collective), through torch and ``torch.distributed`` on any device and dtype."""

from __future__ import annotations

import torch.nn.functional as F

from ...ops import group as groups
from ...ops.collectives import raw_all_gather, raw_reduce_scatter
from ...ops.norm import compute_dtype

__all__ = ["ag_linear_forward", "ag_linear_backward", "ag_linear_keep_forward", "linear_rs_forward",
           "linear_rs_backward", "all_gather_tokens_forward"]


def _rows(t):
    return t.reshape(-1, t.shape[-1])


def _sum_rows(t):
    return _rows(t).sum(0, dtype=compute_dtype(t.dtype)).to(t.dtype)


def ag_linear_forward(x, weight, bias, group):
    return F.linear(raw_all_gather(x, groups.from_name(group)), weight, bias)


def ag_linear_keep_forward(x, weight, bias, group):
    gathered = raw_all_gather(x, groups.from_name(group))
    return F.linear(gathered, weight, bias), gathered


def ag_linear_backward(dy, x, weight, group, need_dx, need_dw, need_db):
    pg = groups.from_name(group)
    dx = raw_reduce_scatter(F.linear(dy, weight.t()), pg) if need_dx else dy.new_empty(0)
    dw = _rows(dy).t().mm(_rows(raw_all_gather(x, pg))) if need_dw else dy.new_empty(0)
    db = _sum_rows(dy) if need_db else dy.new_empty(0)
    return dx, dw, db


def all_gather_tokens_forward(x, group):
    return raw_all_gather(x, groups.from_name(group))


def linear_rs_forward(x, weight, bias, bias_after, group):
    partial = F.linear(x, weight, None if bias_after else bias)
    y = raw_reduce_scatter(partial, groups.from_name(group))
    if bias_after and bias is not None:
        y = y + bias
    return y


def linear_rs_backward(dy, x, weight, bias_after, group, need_dx, need_dw, need_db):
    dy_full = raw_all_gather(dy, groups.from_name(group))
    dx = F.linear(dy_full, weight.t()) if need_dx else dy.new_empty(0)
    dw = _rows(dy_full).t().mm(_rows(x)) if need_dw else dy.new_empty(0)
    db = _sum_rows(dy if bias_after else dy_full) if need_db else dy.new_empty(0)
    return dx, dw, db
