"""GEMMs fused with their tensor-parallel collective: :class:`AllGatherLinear` (sequence-parallel
column layer, ``all_gather_linear``) and :class:`LinearReduceScatter` (sequence-parallel row
layer, ``linear_reduce_scatter``).

* ``all_gather_linear(x, w, b)``: ``y = all_gather_tokens(x) @ w.T + b``. Backward:
  ``dx = reduce_scatter(dy @ w)``, ``dw = dy.T @ all_gather(x)`` (the gathered input is not kept
  between forward and backward: it is gathered again, which overlap implementations hide behind
  the dgrad GEMM), ``db = sum(dy)``.
* ``linear_reduce_scatter(x, w, b, bias_after)``: ``y = reduce_scatter(x @ w.T [+ b]) [+ b]``.
  Backward: ``dy_full = all_gather(dy)``, ``dx = dy_full @ w``, ``dw = dy_full.T @ x``.
"""

from typing import Optional

import torch
from torch import Tensor

from ...ops import group as groups
from .implementations import TABLE as implementations
from ...machinery.fused_op import define_fused_op
from ...machinery.gemm_op import GemmFusedOp, autograd, setup_context

__all__ = ["AllGatherLinear", "LinearReduceScatter"]


def _grads_fake(dy, x, weight, need_dx, need_dw, need_db):
    return (torch.empty_like(x) if need_dx else dy.new_empty(0),
            torch.empty_like(weight) if need_dw else dy.new_empty(0),
            dy.new_empty(weight.shape[0]) if need_db else dy.new_empty(0))


# all_gather_linear ------------------------------------------------------------------------------


def _ag_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], group: str, impl: str) -> Tensor:
    """Prototype."""


def _ag_fake(x, weight, bias, group, impl):
    world = groups.world_size(groups.from_name(group))
    return x.new_empty((x.shape[0] * world,) + tuple(x.shape[1:-1]) + (weight.shape[0],))


def _ag_backward(dy: Tensor, x: Tensor, weight: Tensor, group: str, need_dx: bool, need_dw: bool, need_db: bool,
                 impl: str) -> tuple[Tensor, Tensor, Tensor]:
    """Prototype: ``(dx, dw, db)``, each empty when not needed."""


AG_LINEAR, _ = define_fused_op(
    "all_gather_linear", lookup=implementations.get, forward=_ag_forward, fake=_ag_fake, backward=_ag_backward,
    backward_fake=lambda dy, x, weight, group, need_dx, need_dw, need_db, impl: _grads_fake(
        dy, x, weight, need_dx, need_dw, need_db),
    setup_context=setup_context, autograd=autograd)


# linear_reduce_scatter ----------------------------------------------------------------------------


def _rs_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], bias_after: bool, group: str,
                impl: str) -> Tensor:
    """Prototype."""


def _rs_fake(x, weight, bias, bias_after, group, impl):
    world = groups.world_size(groups.from_name(group))
    return x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:-1]) + (weight.shape[0],))


def _rs_backward(dy: Tensor, x: Tensor, weight: Tensor, bias_after: bool, group: str, need_dx: bool, need_dw: bool,
                 need_db: bool, impl: str) -> tuple[Tensor, Tensor, Tensor]:
    """Prototype: ``(dx, dw, db)``, each empty when not needed."""


def _rs_setup(ctx, inputs, output):
    x, weight, bias, bias_after, group, impl = inputs
    ctx.save_for_backward(x, weight)
    ctx.bias_after, ctx.group, ctx.impl, ctx.has_bias = bias_after, group, impl, bias is not None


def _rs_autograd(backward_op):
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        need_db = need_db and ctx.has_bias
        dx, dw, db = backward_op(dy.contiguous(), x, weight, ctx.bias_after, ctx.group, need_dx, need_dw, need_db,
                                 ctx.impl)
        return dx if need_dx else None, dw if need_dw else None, db if need_db else None, None, None, None

    return backward


LINEAR_RS, _ = define_fused_op(
    "linear_reduce_scatter", lookup=implementations.get, forward=_rs_forward, fake=_rs_fake, backward=_rs_backward,
    backward_fake=lambda dy, x, weight, bias_after, group, need_dx, need_dw, need_db, impl: _grads_fake(
        dy, x, weight, need_dx, need_dw, need_db),
    setup_context=_rs_setup, autograd=_rs_autograd)


# Fused modules --------------------------------------------------------------------------------


class _CollectiveLinear(GemmFusedOp):
    collective = True


class AllGatherLinear(_CollectiveLinear):
    """``y = all_gather_tokens(x) @ weight.T [+ bias]`` (sequence-parallel column layer)."""

    name = "all_gather_linear"

    def forward(self, x):
        return AG_LINEAR(x, self.weight, self.bias, groups.group_name(self.group), self._impl())


class LinearReduceScatter(_CollectiveLinear):
    """``y = reduce_scatter_tokens(x @ weight.T) [+ bias]`` (sequence-parallel row layer).

    ``bias_after=True``: the bias is added once, after the reduction (a row-parallel Linear);
    ``False``: it is added to every rank's partial sum before it (an explicit
    ``BasicLinear -> Bias -> ReduceScatter`` chain).

    ``batch > 1``: ``x`` holds ``batch`` sequences in order and each rank keeps its part of every
    sequence (sequence parallelism at batch > 1, what a model's ``split`` + ``cat`` before a token
    reduce-scatter computes); ``x``'s rows are put rank-major first, so the scatter hands each rank
    ``[batch * seq / world, ...]`` in sequence order.
    """

    name = "linear_reduce_scatter"

    def __init__(self, *, weight, bias=None, group=None, bias_after: bool = True, batch: int = 1):
        super().__init__(weight=weight, bias=bias, group=group)
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"LinearReduceScatter: batch={batch!r}; expected a positive int")
        self.bias_after, self.batch = bias_after, batch

    def _attrs(self) -> dict:
        return {"bias_after": self.bias_after}

    def forward(self, x):
        if self.batch > 1:  # rows (sequence, rank, token) -> (rank, sequence, token)
            k = x.shape[-1]
            x = x.reshape(self.batch, groups.world_size(self.group), -1, k).transpose(0, 1).reshape(-1, k)
        return LINEAR_RS(x, self.weight, self.bias, self.bias_after, groups.group_name(self.group), self._impl())
