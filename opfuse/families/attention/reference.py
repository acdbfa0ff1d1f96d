"""The reference decode attention: the query heads of each key/value head folded into query
positions of that head, through ``F.scaled_dot_product_attention`` (runs anywhere)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["forward"]


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` for ``q [B, H, 1, D]`` over ``k, v [B, Hk, L, D]``
    (query head ``h * (H / Hk) + i`` reads key/value head ``h``) with ``mask [Bm, 1, 1, L]``
    (boolean or additive, ``Bm`` 1 or B); ``[B, H, 1, D]``, contiguous."""
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    folded = q.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, 1, v.shape[-1]).contiguous()
