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

__all__ = ["DecodeAttention", "DECODE_ATTENTION", "choose_decode_attention"]


def _forward(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float, impl: str) -> Tensor:
    """Prototype: attention of ``q [B, H, 1, D]`` over ``k, v [B, Hk, L, D]`` (query head
    ``h * H/Hk + i`` reads key/value head ``h``) with an optional ``mask [Bm, 1, 1, L]`` (boolean or
    additive), ``[B, H, 1, D]``."""


def _fake(q, k, v, mask, scale, impl):
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
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        return DECODE_ATTENTION(q, k, v, mask, float(scale), self._impl())


def choose_decode_attention(q: Tensor, k: Tensor, v: Tensor) -> tuple[Choice, bool]:
    """The implementation for these operands (fake tensors will do): the first capable in table
    order, or the one ``OPFUSE_FORCE_IMPL`` names; and whether it was forced."""
    spec = _spec(TensorMeta.of(q), TensorMeta.of(k), TensorMeta.of(v))
    impls = TABLE.for_op("decode_attention", spec)
    forced = forced_for("decode_attention", impls, parse_force_impl(config.force_impl))
    return choose(spec, impls, forced), forced is not None
