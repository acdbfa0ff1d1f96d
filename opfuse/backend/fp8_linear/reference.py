"""The reference (and CPU) implementation of ``fp8_linear``: the float32 emulation of
:mod:`opfuse.fp8.linear`, on any device."""

from __future__ import annotations

from ...fp8 import linear as fp8_linear
from ...fp8.numerics import Quantized
from ...fp8.recipe import recipe_from_key

__all__ = ["forward", "backward", "reshape_out", "payload_out"]


def forward(x, x_data, x_scale, weight, bias, recipe):
    r = recipe_from_key(recipe)
    if x_data is not None:
        xq = Quantized(x_data.reshape(-1, x_data.shape[-1]), x_scale)
    else:
        xq = fp8_linear.input_operand(x, r)
    y = fp8_linear.emulated_forward(xq, weight, bias, r, x.dtype)
    return reshape_out(y, x, weight, xq, x_data is not None)


def reshape_out(y2d, x, weight, xq, given: bool):
    """``(y, x_data, x_scale)`` in the op's shapes (empty payload when ``x`` came quantized)."""
    return (y2d.reshape(tuple(x.shape[:-1]) + (weight.shape[0],)),) + payload_out(x, xq, given)


def payload_out(x, xq, given: bool):
    """``(x_data, x_scale)`` as the FP8 ops return them: the operand they quantized, or empty
    tensors when ``x`` came quantized (outputs never alias inputs)."""
    if given:
        return xq.data.new_empty(0), xq.scale_inv.new_empty(0)
    return xq.data.reshape(x.shape), xq.scale_inv


def backward(dy, x_data, x_scale, weight, recipe, need_dx, need_dw, need_db):
    dy2 = dy.reshape(-1, dy.shape[-1])
    xq = Quantized(x_data.reshape(-1, x_data.shape[-1]), x_scale)
    return fp8_linear.emulated_backward(dy2, xq, weight, recipe_from_key(recipe), need_dx, need_dw, need_db)
