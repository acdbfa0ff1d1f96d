"""The fused grouped GEMM: the ``opfuse::grouped_linear`` custom op (with its backward op) and
the :class:`GroupedGemm` module that replaces a ``BasicGroupedLinear`` in compiled programs.

The custom op owns what every implementation shares: the FSDP all-gather of the weight shards
before the GEMM, and the reduce-scatter of the weight gradient after it (re-gathering for the
data gradient, so the full weight is not kept alive between forward and backward). The chosen
implementation (``implementations.get("grouped_linear", impl)``) sees only full local tensors::

    forward(x [T, K], group_sizes [G], weight [G, N, K], bias [G, N] | None) -> y [T, N]
    backward(dy, x, group_sizes, weight, *, need_dx, need_dw, need_db) -> (dx, dw, db)

(an output not asked for is an empty tensor; when ``need_dx`` is false ``weight`` may be a
shape-only stand-in and must not be read).
"""

from typing import Optional, Sequence

import torch
from torch import Tensor

from ...ops import group as groups
from ...ops.base import TensorMeta
from ...ops.collectives import raw_all_gather, raw_reduce_scatter
from .implementations import TABLE as implementations
from ...machinery.fused_op import FusedOp, define_fused_op
from ...machinery.implementation import CallSpec

__all__ = ["GroupedGemm", "OP_NAME"]

OP_NAME = "grouped_linear"


def _world(fsdp_group: str) -> int:
    return groups.world_size(groups.from_name(fsdp_group)) if fsdp_group else 1


def _full_shape(weight: Tensor, num_groups: int, fsdp_group: str) -> tuple:
    if not fsdp_group:
        return tuple(weight.shape)
    rows = weight.shape[0] * _world(fsdp_group)
    return num_groups, rows // num_groups, weight.shape[1]


def _gather(t: Optional[Tensor], shape, fsdp_group: str) -> Optional[Tensor]:
    if t is None or not fsdp_group:
        return t
    return raw_all_gather(t, groups.from_name(fsdp_group)).view(shape)


def _grouped_linear(x: Tensor, group_sizes: Tensor, weight: Tensor, bias: Optional[Tensor], fsdp_group: str,
                   impl: str) -> Tensor:
    shape = _full_shape(weight, group_sizes.shape[0], fsdp_group)
    full_w = _gather(weight, shape, fsdp_group)
    full_b = _gather(bias, shape[:2], fsdp_group)
    return implementations.get(OP_NAME, impl).forward(x.contiguous(), group_sizes, full_w, full_b)


def _grouped_linear_fake(x, group_sizes, weight, bias, fsdp_group, impl):
    return x.new_empty(x.shape[0], _full_shape(weight, group_sizes.shape[0], fsdp_group)[1])


def _grouped_linear_backward(dy: Tensor, x: Tensor, group_sizes: Tensor, weight: Tensor, bias: Optional[Tensor],
                            fsdp_group: str, impl: str, need_dx: bool, need_dw: bool,
                            need_db: bool) -> tuple[Tensor, Tensor, Tensor]:
    shape = _full_shape(weight, group_sizes.shape[0], fsdp_group)
    if need_dx:
        full_w = _gather(weight, shape, fsdp_group)
    else:
        # dW and db need only dy and x: skip the all-gather, pass the shape alone.
        full_w = weight.new_empty(()).expand(shape) if fsdp_group else weight
    dx, dw, db = implementations.get(OP_NAME, impl).backward(
        dy.contiguous(), x.contiguous(), group_sizes, full_w, need_dx=need_dx, need_dw=need_dw, need_db=need_db)
    if fsdp_group:
        pg = groups.from_name(fsdp_group)
        if need_dw:
            dw = raw_reduce_scatter(dw.reshape(shape[0] * shape[1], shape[2]), pg)
        if need_db:
            db = raw_reduce_scatter(db.reshape(-1), pg)
    return dx, dw, db


def _grouped_linear_backward_fake(dy, x, group_sizes, weight, bias, fsdp_group, impl, need_dx, need_dw, need_db):
    return (torch.empty_like(x) if need_dx else dy.new_empty(0),
            torch.empty_like(weight) if need_dw else dy.new_empty(0),
            torch.empty_like(bias) if need_db else dy.new_empty(0))


def _setup(ctx, inputs, output):
    x, group_sizes, weight, bias, fsdp_group, impl = inputs
    ctx.save_for_backward(x, group_sizes, weight, bias)
    ctx.fsdp_group, ctx.impl = fsdp_group, impl


def _autograd(backward_op):
    def backward(ctx, dy):
        x, group_sizes, weight, bias = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        need_db = bias is not None and ctx.needs_input_grad[3]
        dx, dw, db = backward_op(dy, x, group_sizes, weight, bias, ctx.fsdp_group, ctx.impl, need_dx, need_dw,
                                 need_db)
        return dx if need_dx else None, None, dw if need_dw else None, db if need_db else None, None, None

    return backward


# The op gathers FSDP shards around the implementation call itself (dispatch=False).
GROUPED_LINEAR, _ = define_fused_op(
    OP_NAME, lookup=implementations.get, forward=_grouped_linear, fake=_grouped_linear_fake,
    backward=_grouped_linear_backward, backward_fake=_grouped_linear_backward_fake, setup_context=_setup,
    autograd=_autograd, dispatch=False)


class GroupedGemm(FusedOp):
    """``y = grouped_linear(x, group_sizes)`` (fused op ``grouped_linear``).

    Shares the parameters of the :class:`~opfuse.ops.grouped.BasicGroupedLinear` it replaces
    (FSDP shards included: the custom op gathers them).
    """

    name = OP_NAME
    # torch_compile/fp8_lower.py points the joint graph's grouped_linear_backward at this choice
    backward_follows_implementation = True

    def __init__(self, *, weight, bias, num_groups: int, in_features: int, out_features: int,
                 fsdp: bool = False, fsdp_group=None):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.num_groups = num_groups
        self.in_features = in_features
        self.out_features = out_features
        self.fsdp = fsdp
        self.fsdp_group = fsdp_group

    @classmethod
    def from_op(cls, op) -> "GroupedGemm":
        return cls(weight=op.weight, bias=op.bias, num_groups=op.num_groups, in_features=op.in_features,
                   out_features=op.out_features, fsdp=op.fsdp, fsdp_group=op.fsdp_group)

    def _fsdp_name(self) -> str:
        return groups.group_name(self.fsdp_group) if self.fsdp else ""

    def extra_repr(self) -> str:
        text = f"num_groups={self.num_groups}, in={self.in_features}, out={self.out_features}"
        if self.bias is not None:
            text += ", bias"
        if self.fsdp:
            text += f", fsdp_group={self._fsdp_name()}"
        return text + (f", impl={self.impl}" if self.impl else "")

    def call_spec(self, metas: Sequence[TensorMeta]) -> CallSpec:
        x, sizes = metas[0], metas[1]
        full = TensorMeta((self.num_groups, self.out_features, self.in_features), self.weight.dtype,
                          self.weight.device, self.weight.requires_grad)
        bias = None
        if self.bias is not None:
            bias = TensorMeta((self.num_groups, self.out_features), self.bias.dtype, self.bias.device,
                              self.bias.requires_grad)
        params = [p for p in (self.weight, self.bias) if p is not None]
        requires_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
        return CallSpec(
            op=self.name,
            inputs={"x": x, "group_sizes": sizes, "weight": full, "bias": bias},
            attrs={"fsdp": self.fsdp},
            group_name=self._fsdp_name() or None,
            world_size=groups.world_size(self.fsdp_group) if self.fsdp else 1,
            requires_grad=requires_grad,
        )

    def forward(self, x, group_sizes):
        return GROUPED_LINEAR(x, group_sizes, self.weight, self.bias, self._fsdp_name(), self._impl())
