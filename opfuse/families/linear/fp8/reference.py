"""The reference (and CPU) implementation of ``fp8_linear``: the float32 emulation of
:mod:`opfuse.fp8.linear`, on any device."""

from __future__ import annotations

import torch

from ....fp8 import linear as fp8_linear
from ....fp8.numerics import Quantized
from ....fp8.recipe import recipe_from_key
from ....fp8.state import weight_trained

__all__ = ["forward", "backward", "reshape_out", "payload_out", "transposes_x", "payload_fake"]


def forward(x, x_data, x_scale, weight, bias, recipe):
    r = recipe_from_key(recipe)
    if x_data is not None:
        xq = Quantized(x_data.reshape(-1, x_data.shape[-1]), x_scale)
    else:
        xq = fp8_linear.input_operand(x, r)
    y = fp8_linear.emulated_forward(xq, weight, bias, r, x.dtype)
    return reshape_out(y, x, weight, xq, x_data is not None)


def reshape_out(y2d, x, weight, xq, given: bool, xt=None):
    """``(y, x_data, x_scale, x_data_t)`` in the op's shapes (:func:`payload_out`)."""
    return (y2d.reshape(tuple(x.shape[:-1]) + (weight.shape[0],)),) + payload_out(x, xq, given, xt)


def payload_out(x, xq, given: bool, xt=None):
    """``(x_data, x_scale, x_data_t)`` as the FP8 ops return them: the operand they quantized (and
    its transposed bytes, ``xt``, when made), or empty tensors when ``x`` came quantized (outputs
    never alias inputs)."""
    empty_t = xq.data.new_empty(0) if xt is None else xt.data
    if given:
        return xq.data.new_empty(0), xq.scale_inv.new_empty(0), empty_t
    return xq.data.reshape(x.shape), xq.scale_inv, empty_t


def backward(dy, x_data, x_scale, x_data_t, weight, recipe, need_dx, need_dw, need_db):
    dy2 = dy.reshape(-1, dy.shape[-1])
    xq = Quantized(x_data.reshape(-1, x_data.shape[-1]), x_scale)
    return fp8_linear.emulated_backward(dy2, xq, weight, recipe_from_key(recipe), need_dx, need_dw, need_db)


def transposes_x(x_given: bool, weight: torch.Tensor, recipe: str, impl: str) -> bool:
    """Whether an implementation returns the transposed bytes of the ``x`` it quantized: the GPU
    ones, for one scale per tensor and a weight that takes an FP8 gradient."""
    return impl != "reference" and not x_given and recipe.startswith("tensor") and recipe.endswith("wgrad-fp8") \
        and weight_trained(weight)


def payload_fake(x, x_data, weight, recipe, impl):
    """Fake ``(x_data, x_scale, x_data_t)`` outputs of the FP8 GEMM ops."""
    fp8 = torch.float8_e4m3fn
    if x_data is not None:
        return x.new_empty(0, dtype=fp8), x.new_empty(0, dtype=torch.float32), x.new_empty(0, dtype=fp8)
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    scale_rows = rows if recipe.startswith("row") else 1
    data_t = x.new_empty((x.shape[-1], rows), dtype=fp8) if transposes_x(False, weight, recipe, impl) else \
        x.new_empty(0, dtype=fp8)
    return x.new_empty(x.shape, dtype=fp8), x.new_empty((scale_rows, 1), dtype=torch.float32), data_t
