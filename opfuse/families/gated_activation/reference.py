"""Reference implementation of ``gated_activation``: the two halves of the packed value, the
activation, the product; backward in the compute dtype (float32 for half types), rounded once."""

from __future__ import annotations

import torch

from ...ops.activation import ACTIVATIONS
from ...ops.norm import compute_dtype

__all__ = ["forward", "backward", "activation_backward"]


def forward(y, activation):
    gate, up = y.chunk(2, dim=-1)
    return (ACTIVATIONS[activation](gate.to(compute_dtype(y.dtype))) * up).to(y.dtype)


def activation_backward(grad, gate, activation):
    """``grad * act'(gate)``."""
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, gate)
    return torch.ops.aten.gelu_backward(grad, gate, approximate="tanh" if activation == "gelu_tanh" else "none")


def backward(dout, y, activation):
    """The gradient of the packed value: ``[dout * up * act'(gate) | dout * act(gate)]``."""
    ct = compute_dtype(y.dtype)
    gate, up = (t.to(ct) for t in y.chunk(2, dim=-1))
    dout = dout.to(ct)
    dgate = activation_backward(dout * up, gate, activation)
    dup = dout * ACTIVATIONS[activation](gate)
    return torch.cat([dgate, dup], dim=-1).to(y.dtype)
