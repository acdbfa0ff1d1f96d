"""GEMMs fused with their tensor-parallel collective: :class:`AllGatherLinear` (sequence-parallel
column layer) and :class:`LinearReduceScatter` (sequence-parallel row layer).

Custom ops (each with a backward op):

* ``opfuse::all_gather_linear(x, w, b)``: ``y = all_gather_tokens(x) @ w.T + b``. Backward:
  ``dx = reduce_scatter(dy @ w)``, ``dw = dy.T @ all_gather(x)`` (the gathered input is not kept
  between forward and backward: it is gathered again, which overlap implementations hide behind
  the dgrad GEMM), ``db = sum(dy)``.
* ``opfuse::linear_reduce_scatter(x, w, b, bias_after)``: ``y = reduce_scatter(x @ w.T [+ b]) [+ b]``.
  Backward: ``dy_full = all_gather(dy)``, ``dx = dy_full @ w``, ``dw = dy_full.T @ x``.

Reference implementations (torch + torch.distributed, any device) live here; the peer-memory
overlap implementations register in :mod:`opfuse.backend.table`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ...ops import group as groups
from ...ops.base import TensorMeta
from ...ops.norm import compute_dtype
from ...ops.collectives import raw_all_gather, raw_reduce_scatter
from .. import dispatch
from .base import FusedCall, FusedOp

__all__ = ["AllGatherLinear", "LinearReduceScatter", "ag_linear_reference", "ag_linear_backward_reference",
           "linear_rs_reference", "linear_rs_backward_reference"]


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


# Reference implementations ------------------------------------------------------------------


def ag_linear_reference(x, weight, bias, *, group):
    return F.linear(raw_all_gather(x, groups.from_name(group)), weight, bias)


def ag_linear_backward_reference(dy, x, weight, *, group, need_dx, need_dw, need_db):
    pg = groups.from_name(group)
    dx = raw_reduce_scatter(F.linear(dy, weight.t()), pg) if need_dx else _empty(dy)
    dw = _rows(dy).t().mm(_rows(raw_all_gather(x, pg))) if need_dw else _empty(dy)
    db = _rows(dy).sum(0, dtype=compute_dtype(dy.dtype)).to(dy.dtype) if need_db else _empty(dy)
    return dx, dw, db


def linear_rs_reference(x, weight, bias, *, bias_after, group):
    partial = F.linear(x, weight, None if bias_after else bias)
    y = raw_reduce_scatter(partial, groups.from_name(group))
    if bias_after and bias is not None:
        y = y + bias
    return y


def linear_rs_backward_reference(dy, x, weight, *, bias_after, group, need_dx, need_dw, need_db):
    dy_full = raw_all_gather(dy, groups.from_name(group))
    dx = F.linear(dy_full, weight.t()) if need_dx else _empty(dy)
    dw = _rows(dy_full).t().mm(_rows(x)) if need_dw else _empty(dy)
    db = _empty(dy)
    if need_db:
        db = _rows(dy if bias_after else dy_full).sum(0, dtype=compute_dtype(dy.dtype)).to(dy.dtype)
    return dx, dw, db


# Custom ops ---------------------------------------------------------------------------------


def _all_gather_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], group: str, impl: str) -> Tensor:
    return dispatch.get("all_gather_linear", impl).forward(x, weight, bias, group=group)


def _all_gather_linear_fake(x, weight, bias, group, impl):
    world = groups.world_size(groups.from_name(group))
    return x.new_empty((x.shape[0] * world,) + tuple(x.shape[1:-1]) + (weight.shape[0],))


def _all_gather_linear_backward(dy: Tensor, x: Tensor, weight: Tensor, group: str, impl: str, need_dx: bool,
                                need_dw: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    chosen = dispatch.get("all_gather_linear", impl)
    backward = chosen.backward or ag_linear_backward_reference
    return backward(dy, x, weight, group=group, need_dx=need_dx, need_dw=need_dw, need_db=need_db)


def _grads_fake(dy, x, weight, need_dx, need_dw, need_db):
    return (torch.empty_like(x) if need_dx else dy.new_empty(0),
            torch.empty_like(weight) if need_dw else dy.new_empty(0),
            dy.new_empty(weight.shape[0]) if need_db else dy.new_empty(0))


AG_LINEAR_BACKWARD = FusedCall(
    "opfuse::all_gather_linear_backward", _all_gather_linear_backward,
    lambda dy, x, weight, group, impl, need_dx, need_dw, need_db: _grads_fake(dy, x, weight, need_dx, need_dw,
                                                                             need_db))


def _ag_setup(ctx, inputs, output):
    x, weight, bias, group, impl = inputs
    ctx.save_for_backward(x, weight)
    ctx.group, ctx.impl, ctx.has_bias = group, impl, bias is not None


def _ag_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    dx, dw, db = AG_LINEAR_BACKWARD(dy.contiguous(), x, weight, ctx.group, ctx.impl, need_dx, need_dw,
                                    need_db and ctx.has_bias)
    return (dx if need_dx else None, dw if need_dw else None, db if need_db and ctx.has_bias else None,
            None, None)


AG_LINEAR = FusedCall("opfuse::all_gather_linear", _all_gather_linear, _all_gather_linear_fake, _ag_setup,
                      _ag_backward)


def _linear_reduce_scatter(x: Tensor, weight: Tensor, bias: Optional[Tensor], bias_after: bool, group: str,
                           impl: str) -> Tensor:
    return dispatch.get("linear_reduce_scatter", impl).forward(x, weight, bias, bias_after=bias_after, group=group)


def _linear_reduce_scatter_fake(x, weight, bias, bias_after, group, impl):
    world = groups.world_size(groups.from_name(group))
    return x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:-1]) + (weight.shape[0],))


def _linear_reduce_scatter_backward(dy: Tensor, x: Tensor, weight: Tensor, bias_after: bool, group: str, impl: str,
                                    need_dx: bool, need_dw: bool, need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    chosen = dispatch.get("linear_reduce_scatter", impl)
    backward = chosen.backward or linear_rs_backward_reference
    return backward(dy, x, weight, bias_after=bias_after, group=group, need_dx=need_dx, need_dw=need_dw,
                    need_db=need_db)


LINEAR_RS_BACKWARD = FusedCall(
    "opfuse::linear_reduce_scatter_backward", _linear_reduce_scatter_backward,
    lambda dy, x, weight, bias_after, group, impl, need_dx, need_dw, need_db: _grads_fake(dy, x, weight, need_dx,
                                                                                         need_dw, need_db))


def _rs_setup(ctx, inputs, output):
    x, weight, bias, bias_after, group, impl = inputs
    ctx.save_for_backward(x, weight)
    ctx.bias_after, ctx.group, ctx.impl, ctx.has_bias = bias_after, group, impl, bias is not None


def _rs_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    dx, dw, db = LINEAR_RS_BACKWARD(dy.contiguous(), x, weight, ctx.bias_after, ctx.group, ctx.impl, need_dx,
                                    need_dw, need_db and ctx.has_bias)
    return (dx if need_dx else None, dw if need_dw else None, db if need_db and ctx.has_bias else None,
            None, None, None)


LINEAR_RS = FusedCall("opfuse::linear_reduce_scatter", _linear_reduce_scatter, _linear_reduce_scatter_fake,
                      _rs_setup, _rs_backward)


# Fused modules --------------------------------------------------------------------------------


class _CommLinear(FusedOp):
    def __init__(self, *, weight, bias=None, group=None):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.group = group

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        text = f"in={inp}, out={out}, group={groups.group_name(self.group)}"
        if self.bias is not None:
            text += ", bias"
        if self.impl:
            text += f", impl={self.impl}"
        return text

    def call_spec(self, metas: Sequence[TensorMeta]) -> dispatch.CallSpec:
        params = [p for p in (self.weight, self.bias) if p is not None]
        requires_grad = torch.is_grad_enabled() and (metas[0].requires_grad or any(p.requires_grad for p in params))
        return dispatch.CallSpec(
            op=self.op_name,
            inputs={"x": metas[0], "weight": TensorMeta.of(self.weight),
                    "bias": None if self.bias is None else TensorMeta.of(self.bias)},
            attrs=self._attrs(),
            group_name=groups.group_name(self.group),
            world_size=groups.world_size(self.group),
            requires_grad=requires_grad,
        )

    def _attrs(self) -> dict:
        return {}


class AllGatherLinear(_CommLinear):
    """``y = all_gather_tokens(x) @ weight.T [+ bias]`` (sequence-parallel column layer)."""

    op_name = "all_gather_linear"

    def forward(self, x):
        return AG_LINEAR(x, self.weight, self.bias, groups.group_name(self.group), self._impl())


class LinearReduceScatter(_CommLinear):
    """``y = reduce_scatter_tokens(x @ weight.T) [+ bias]`` (sequence-parallel row layer).

    ``bias_after=True``: the bias is added once, after the reduction (a row-parallel Linear);
    ``False``: it is added to every rank's partial sum before it (an explicit
    ``BasicLinear -> Bias -> ReduceScatter`` chain).
    """

    op_name = "linear_reduce_scatter"

    def __init__(self, *, weight, bias=None, group=None, bias_after: bool = True):
        super().__init__(weight=weight, bias=bias, group=group)
        self.bias_after = bias_after

    def _attrs(self) -> dict:
        return {"bias_after": self.bias_after}

    def forward(self, x):
        return LINEAR_RS(x, self.weight, self.bias, self.bias_after, groups.group_name(self.group), self._impl())
