"""Reference implementation of ``linear_bias_activation``: ``addmm`` then the activation, keeping
the pre-activation for backward as the unfused ops would."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops.norm import compute_dtype

__all__ = ["ACTIVATIONS", "approximate", "forward", "backward"]

#: Activation name -> ``F.gelu``'s ``approximate``.
ACTIVATIONS = {"gelu": "none", "gelu_tanh": "tanh"}


def approximate(activation: str) -> str:
    try:
        return ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(f"linear_bias_activation: activation={activation!r}; accepted: {sorted(ACTIVATIONS)}") from None


def forward(x, weight, bias, activation, save_pre):
    pre = F.linear(x, weight, bias)
    y = F.gelu(pre, approximate=approximate(activation))
    return y, (pre if save_pre else x.new_empty(0))


def backward(dy, x, weight, pre, activation):
    dpre = torch.ops.aten.gelu_backward(dy, pre, approximate=approximate(activation))
    rows = dpre.reshape(-1, dpre.shape[-1])
    dx = F.linear(dpre, weight.t())
    dw = rows.t().mm(x.reshape(-1, x.shape[-1]))
    db = rows.sum(0, dtype=compute_dtype(dy.dtype)).to(dy.dtype)
    return dx, dw, db
