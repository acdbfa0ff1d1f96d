"""What the fused ops built around one GEMM ``y = x @ weight.T (+ bias)`` share (the collective
GEMMs, the FP8 GEMM, the horizontal GEMM): the module over the matched linear's parameters, how it
describes itself and a call (:class:`GemmFusedOp`), and the autograd glue of a custom op taking
``(x, weight, bias, group, impl)`` whose backward returns ``(dx, dw, db)``
(:func:`setup_context`, :func:`autograd`)."""

from __future__ import annotations

from typing import ClassVar, Sequence

import torch

from ..ops import group as groups
from ..ops.base import TensorMeta
from .fused_op import FusedOp
from .implementation import CallSpec

__all__ = ["GemmFusedOp", "setup_context", "autograd"]


class GemmFusedOp(FusedOp):
    """A fused op around one GEMM, sharing (not copying) the matched linear's ``weight`` and
    ``bias``; ``group`` is its collective's process group (``None``: the default group) when the
    class is ``collective``, ``recipe`` its FP8 recipe (``None``: not FP8). The dispatch sees
    ``x``, ``weight`` and ``bias``; subclasses add attributes with :meth:`_attrs`."""

    #: Whether the op runs a collective over ``group``.
    collective: ClassVar[bool] = False

    def __init__(self, *, weight, bias=None, group=None, recipe=None):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.group = group
        self.recipe = recipe

    def _attrs(self) -> dict:
        return {}

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        parts = [f"in={inp}", f"out={out}"]
        if self.collective:
            parts.append(f"group={groups.group_name(self.group)}")
        if self.recipe is not None:
            parts.append(self.recipe.describe())
        if self.bias is not None:
            parts.append("bias")
        if self.impl:
            parts.append(f"impl={self.impl}")
        return ", ".join(parts)

    def call_spec(self, metas: Sequence[TensorMeta]) -> CallSpec:
        params = [p for p in (self.weight, self.bias) if p is not None]
        requires_grad = torch.is_grad_enabled() and (metas[0].requires_grad or any(p.requires_grad for p in params))
        attrs = {"recipe": self.recipe} if self.recipe is not None else {}
        group = {"group_name": groups.group_name(self.group), "world_size": groups.world_size(self.group)} \
            if self.collective else {}
        return CallSpec(op=self.name, inputs={"x": metas[0], "weight": TensorMeta.of(self.weight),
                                              "bias": None if self.bias is None else TensorMeta.of(self.bias)},
                        attrs={**attrs, **self._attrs()}, requires_grad=requires_grad, **group)


def setup_context(ctx, inputs, output):
    """``register_autograd``'s setup for custom ops ``(x, weight, bias, group, impl)``."""
    x, weight, bias, group, impl = inputs
    ctx.save_for_backward(x, weight)
    ctx.group, ctx.impl, ctx.has_bias = group, impl, bias is not None


def autograd(backward_op):
    """The backward of custom ops ``(x, weight, bias, group, impl)``: their backward op called as
    ``(dy, x, weight, group, need_dx, need_dw, need_db, impl) -> (dx, dw, db)``."""

    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = ctx.needs_input_grad[2] and ctx.has_bias
        dx, dw, db = backward_op(dy.contiguous(), x, weight, ctx.group, need_dx, need_dw, need_db, ctx.impl)
        return dx if need_dx else None, dw if need_dw else None, db if need_db else None, None, None

    return backward
