"""``horizontal_linear``: linears that read the same value as one GEMM.

``HorizontalLinear(weights=[w_1, ..., w_k], biases=[b_1, ..., b_k] or None, all_gather=False, group=g)``
computes ``y = [all_gather_tokens(x, g) if all_gather] @ [w_1; ...; w_k].T + [b_1; ...; b_k]`` and returns
``y`` split back into the k outputs (views of one tensor), or ``y`` itself with ``split=False``
(for a consumer that reads the packed value, e.g. the gated activation of ``[gate | up]``). The joined weight is a view of the
users' parameters when they lie back to back in memory (:func:`~opfuse.ops.packing.join_rows`),
so nothing is copied, and its gradient is split back into each parameter's gradient.

Custom ops: ``opfuse::horizontal_linear(x, weight, bias, group, impl)`` and its backward, over
the joined tensors; ``group`` is the token all-gather's process group (sequence parallel) or
``None``. Backward: ``dx = dy @ W`` (reduce-scattered when gathered), ``dW = dy.T @ x`` (gathered
``x``), ``db = sum(dy)``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from ...ops import group as groups
from ...ops.base import TensorMeta
from ...ops.packing import join_rows
from .implementations import TABLE as implementations
from ...machinery.fused_op import FusedOp, define_fused_op
from ...machinery.gemm_op import autograd, setup_context
from ...machinery.implementation import CallSpec

__all__ = ["HorizontalLinear"]


def _forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], group: Optional[str], impl: str) -> Tensor:
    """Prototype."""


def _fake(x, weight, bias, group, impl):
    # x's leading dims stay (none for a 1-D input); the gather multiplies the token dim (dim 0).
    leading = list(x.shape[:-1])
    if group is not None:
        leading[0] *= groups.world_size(groups.from_name(group))
    return x.new_empty(tuple(leading) + (weight.shape[0],))


def _backward(dy: Tensor, x: Tensor, weight: Tensor, group: Optional[str], need_dx: bool, need_dw: bool,
              need_db: bool, impl: str) -> tuple[Tensor, Tensor, Tensor]:
    """Prototype: ``(dx, dw, db)``, each empty when not needed."""


def _backward_fake(dy, x, weight, group, need_dx, need_dw, need_db, impl):
    return (torch.empty_like(x) if need_dx else dy.new_empty(0),
            torch.empty_like(weight) if need_dw else dy.new_empty(0),
            dy.new_empty(weight.shape[0]) if need_db else dy.new_empty(0))


HORIZONTAL_LINEAR, _ = define_fused_op(
    "horizontal_linear", lookup=implementations.get, forward=_forward, fake=_fake, backward=_backward,
    backward_fake=_backward_fake, setup_context=setup_context, autograd=autograd)


class HorizontalLinear(FusedOp):
    """Several GEMMs over one input as one (see the module docstring). The parameters are the
    original layers' own (shared, not copied)."""

    name = "horizontal_linear"

    def __init__(self, weights: Sequence[nn.Parameter], biases: Sequence[nn.Parameter] | None = None, *,
                 all_gather: bool = False, group=None, split: bool = True):
        super().__init__()
        if len(weights) < 2:
            raise ValueError(f"HorizontalLinear: needs at least 2 weights, got {len(weights)}")
        if biases is not None and len(biases) != len(weights):
            raise ValueError(f"HorizontalLinear: {len(weights)} weights but {len(biases)} biases")
        self.weights = nn.ParameterList(weights)
        self.biases = nn.ParameterList(biases) if biases is not None else None
        self.all_gather, self.group, self.split = bool(all_gather), group, bool(split)
        self.sizes = [w.shape[0] for w in weights]

    def extra_repr(self) -> str:
        text = f"in={self.weights[0].shape[1]}, outs={self.sizes}"
        if self.biases is not None:
            text += ", bias"
        if self.all_gather:
            text += f", all_gather={groups.group_name(self.group)}"
        if not self.split:
            text += ", packed"
        return text + (f", impl={self.impl}" if self.impl else "")

    def _group_name(self) -> str | None:
        """The all-gather's group (``group=None`` is the default group), or ``None``: no gather."""
        return groups.group_name(self.group) if self.all_gather else None

    def call_spec(self, metas: Sequence[TensorMeta]) -> CallSpec:
        first = self.weights[0]
        params = [*self.weights, *(self.biases or ())]
        requires_grad = torch.is_grad_enabled() and (metas[0].requires_grad or any(p.requires_grad for p in params))
        weight = TensorMeta((sum(self.sizes), first.shape[1]), first.dtype, first.device,
                            any(w.requires_grad for w in self.weights))
        bias = None
        if self.biases is not None:
            b = self.biases[0]
            bias = TensorMeta((sum(self.sizes),), b.dtype, b.device, any(p.requires_grad for p in self.biases))
        return CallSpec(op=self.name, inputs={"x": metas[0], "weight": weight, "bias": bias},
                        attrs={"outputs": len(self.sizes)}, group_name=self._group_name(),
                        world_size=groups.world_size(self.group) if self.all_gather else 1,
                        requires_grad=requires_grad)

    def forward(self, x):
        weight = join_rows(list(self.weights))
        bias = join_rows(list(self.biases)) if self.biases is not None else None
        y = HORIZONTAL_LINEAR(x, weight, bias, self._group_name(), self._impl())
        return tuple(y.split(self.sizes, dim=-1)) if self.split else y
