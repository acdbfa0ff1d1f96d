"""The fused op ``decode_attention`` (custom op ``opfuse::decode_attention``, no autograd: decode
graphs only), its module, and the choice of its implementation for the torch.compile front end,
which writes it into aten graphs (``torch_compile/grouped_attention.py``)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from ...config import config, parse_force_impl
from ...machinery.fused_op import FusedOp, define_fused_op
from ...machinery.implementation import CallSpec, Choice, choose, forced_for
from ...ops.base import TensorMeta
from .implementations import TABLE

__all__ = ["DecodeAttention", "DECODE_ATTENTION", "choose_decode_attention", "check_operands"]


def _forward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float, impl: str) -> Tensor:
    """Prototype: attention of ``q [B, H, 1, D]`` over ``k, v [B, Hk, L, D]`` (query head
    ``h * H/Hk + i`` reads key/value head ``h``) with an optional ``mask [Bm, 1, 1, L]`` (boolean or
    additive), ``[B, H, 1, D]``."""


def check_operands(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> None:
    """Raise ``ValueError`` naming the operand unless ``q [B, H, 1, D]``, ``k [B, Hk, L, D]``,
    ``v [B, Hk, L, Dv]`` with ``H`` a multiple of ``Hk``, all of one dtype, and ``mask`` None or
    ``[B or 1, 1, 1, L]`` (boolean or additive)."""
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"decode_attention: query of shape {list(q.shape)}; expected [batch, heads, 1, head_dim] "
                         f"(one query position: decode)")
    batch, heads, _, dim = q.shape
    if k.dim() != 4 or k.shape[0] != batch or k.shape[3] != dim:
        raise ValueError(f"decode_attention: key of shape {list(k.shape)}; expected [{batch}, kv_heads, positions, "
                         f"{dim}] for a query of shape {list(q.shape)}")
    if v.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"decode_attention: value of shape {list(v.shape)}; expected [{', '.join(map(str, k.shape[:3]))}"
                         f", value_dim] for a key of shape {list(k.shape)}")
    for name, t in (("key", k), ("value", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"decode_attention: {name} dtype {t.dtype}; expected the query's, {q.dtype}")
    kv_heads, length = k.shape[1], k.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"decode_attention: {heads} query heads over {kv_heads} key/value heads; expected a "
                         f"multiple (grouped-query attention)")
    if mask is not None and (mask.dim() != 4 or mask.shape[0] not in (1, batch) or mask.shape[1] != 1
                             or mask.shape[2] != 1 or mask.shape[3] != length):
        raise ValueError(f"decode_attention: mask of shape {list(mask.shape)}; expected [{batch} or 1, 1, 1, "
                         f"{length}] (one mask for every head)")
    if mask is not None and not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise ValueError(f"decode_attention: mask dtype {mask.dtype}; expected torch.bool or a floating dtype")


def _fake(q, k, v, mask, scale, impl):
    check_operands(q, k, v, mask)
    batch, heads = q.shape[:2]
    return q.new_empty((batch, heads, 1, v.shape[-1]))


DECODE_ATTENTION, _ = define_fused_op("decode_attention", lookup=TABLE.get, forward=_forward, fake=_fake)


def _spec(q: TensorMeta, k: TensorMeta, v: TensorMeta) -> CallSpec:
    return CallSpec(op="decode_attention", inputs={"x": q, "key": k, "value": v}, attrs={})


class DecodeAttention(FusedOp):
    """``decode_attention(q, k, v, mask)`` with softmax scale ``scale`` (``None``: 1 / sqrt(D))."""

    name = "decode_attention"

    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale

    def call_spec(self, metas: Sequence[TensorMeta]) -> CallSpec:
        return _spec(*metas[:3])

    def forward(self, q, k, v, mask=None):
        check_operands(q, k, v, mask)
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        return DECODE_ATTENTION(q, k, v, mask, float(scale), self._impl())


def choose_decode_attention(q: Tensor, k: Tensor, v: Tensor) -> tuple[Choice, bool]:
    """The implementation for these operands (fake tensors will do): the first capable in table
    order, or the one ``OPFUSE_FORCE_IMPL`` names; and whether it was forced."""
    spec = _spec(TensorMeta.of(q), TensorMeta.of(k), TensorMeta.of(v))
    impls = TABLE.for_op("decode_attention", spec)
    forced = forced_for("decode_attention", impls, parse_force_impl(config.force_impl))
    return choose(spec, impls, forced), forced is not None
