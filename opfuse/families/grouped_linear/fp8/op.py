"""``grouped_linear_fp8``: the grouped GEMM of an FP8 ``BasicGroupedLinear`` (``x`` quantized inside, one
scale per tensor ignoring the rows past ``sum(group_sizes)``, or one per token; the weight per expert
or per output channel; see :mod:`opfuse.fp8.grouped`). Implementations::

    forward(x, group_sizes, weight, bias | None, fsdp_group, num_groups, recipe) -> y
    backward(dy, x, group_sizes, weight, bias | None, fsdp_group, num_groups, recipe,
             need_dx, need_dw, need_db) -> (dx, dw, db)

``weight`` / ``bias`` are this rank's parameters (FSDP shards when ``fsdp_group`` names a group);
gradients come back in the parameters' shapes (reduce-scattered under FSDP).
"""

import dataclasses
from typing import Optional, Sequence

import torch
from torch import Tensor

from ....fp8.recipe import Recipe
from ....ops import group as groups
from ....ops.base import TensorMeta
from ..implementations import TABLE as implementations
from ..op import GroupedGemm
from ....machinery.fused_op import define_fused_op
from ....machinery.implementation import CallSpec

__all__ = ["GroupedGemmFp8"]


def _forward(x: Tensor, group_sizes: Tensor, weight: Tensor, bias: Optional[Tensor], fsdp_group: str,
             num_groups: int, recipe: str, impl: str) -> Tensor:
    """Prototype."""


def _fake(x, group_sizes, weight, bias, fsdp_group, num_groups, recipe, impl):
    world = groups.world_size(groups.from_name(fsdp_group)) if fsdp_group else 1
    n = weight.shape[0] * world // num_groups if fsdp_group else weight.shape[1]
    return x.new_empty(x.shape[0], n)


def _backward(dy: Tensor, x: Tensor, group_sizes: Tensor, weight: Tensor, bias: Optional[Tensor], fsdp_group: str,
              num_groups: int, recipe: str, need_dx: bool, need_dw: bool, need_db: bool,
              impl: str) -> tuple[Tensor, Tensor, Tensor]:
    """Prototype: ``(dx, dw, db)``, each empty when not needed."""


def _backward_fake(dy, x, group_sizes, weight, bias, fsdp_group, num_groups, recipe, need_dx, need_dw, need_db, impl):
    return (torch.empty_like(x) if need_dx else dy.new_empty(0),
            torch.empty_like(weight) if need_dw else dy.new_empty(0),
            torch.empty_like(bias) if need_db else dy.new_empty(0))


def _setup(ctx, inputs, output):
    x, group_sizes, weight, bias, fsdp_group, num_groups, recipe, impl = inputs
    ctx.save_for_backward(x, group_sizes, weight, bias)
    ctx.args = (fsdp_group, num_groups, recipe)
    ctx.impl = impl


def _autograd(backward_op):
    def backward(ctx, dy):
        x, group_sizes, weight, bias = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        need_db = bias is not None and ctx.needs_input_grad[3]
        dx, dw, db = backward_op(dy.contiguous(), x, group_sizes, weight, bias, *ctx.args, need_dx, need_dw, need_db,
                                 ctx.impl)
        return (dx if need_dx else None, None, dw if need_dw else None, db if need_db else None, None, None, None,
                None)

    return backward


GROUPED_LINEAR_FP8, _ = define_fused_op(
    "grouped_linear_fp8", lookup=implementations.get, forward=_forward, fake=_fake, backward=_backward,
    backward_fake=_backward_fake, setup_context=_setup, autograd=_autograd)


class GroupedGemmFp8(GroupedGemm):
    """``y = grouped_linear(x, group_sizes)`` on FP8 operands (fused op ``grouped_linear_fp8``): the
    grouped GEMM's module with a recipe."""

    name = "grouped_linear_fp8"

    def __init__(self, *, recipe: Recipe, **kwargs):
        super().__init__(**kwargs)
        self.recipe = recipe

    @classmethod
    def from_op(cls, op) -> "GroupedGemmFp8":
        return cls(weight=op.weight, bias=op.bias, num_groups=op.num_groups, in_features=op.in_features,
                   out_features=op.out_features, recipe=op.recipe, fsdp=op.fsdp, fsdp_group=op.fsdp_group)

    def extra_repr(self) -> str:
        text, _, tail = super().extra_repr().partition(", impl=")
        return f"{text}, {self.recipe.describe()}" + (f", impl={tail}" if tail else "")

    def call_spec(self, metas: Sequence[TensorMeta]) -> CallSpec:
        spec = super().call_spec(metas)
        return dataclasses.replace(spec, op=self.name, attrs={**spec.attrs, "recipe": self.recipe})

    def forward(self, x, group_sizes):
        return GROUPED_LINEAR_FP8(x, group_sizes, self.weight, self.bias, self._fsdp_name(), self.num_groups,
                                  self.recipe.key(), self._impl())
