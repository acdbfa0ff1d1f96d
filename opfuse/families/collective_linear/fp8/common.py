"""What the FP8 collective GEMMs share: the local FP8 operand of ``x`` (one scale shared by the
group's ranks, so the gathered tensor has one scale too; or one per row), and the gather of FP8
operands (the bytes, moved as ``uint8``, and per-row scales)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ....fp8.numerics import Quantized
from ....ops.collectives import raw_all_gather, start_all_gather

__all__ = ["shared_quantize", "local_operand", "gather", "start_gather"]


def shared_quantize(rows: torch.Tensor, dtype: torch.dtype, rowwise: bool, pg, quantize, amax) -> Quantized:
    """``rows`` quantized with ``quantize(rows, dtype, rowwise, amax_value=)``; one scale per tensor
    comes from ``amax(rows)`` all-reduced (MAX) over ``pg``."""
    if rowwise:
        return quantize(rows, dtype, True)
    a = amax(rows)
    if dist.get_world_size(pg) > 1:
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=pg)
    return quantize(rows, dtype, False, amax_value=a)


def local_operand(x, x_data, x_scale, recipe, pg, quantize, amax) -> Quantized:
    """This rank's ``[rows, K]`` FP8 operand: the given payload, or ``x`` quantized (shared scale)."""
    k = x.shape[-1]
    if x_data is not None:
        return Quantized(x_data.reshape(-1, k), x_scale)
    return shared_quantize(x.reshape(-1, k), recipe.forward_dtype, recipe.rowwise, pg, quantize, amax)


def gather(q: Quantized, pg) -> Quantized:
    """Every rank's operand concatenated along rows (a shared scale stays one scale)."""
    data = raw_all_gather(q.data.view(torch.uint8), pg).view(q.data.dtype)
    scale = q.scale_inv if q.scale_inv.numel() == 1 else raw_all_gather(q.scale_inv, pg)
    return Quantized(data, scale)


def start_gather(q: Quantized, pg):
    """:func:`gather` as ``(finish, )``: ``finish()`` waits and returns the gathered operand."""
    data, work = start_all_gather(q.data.view(torch.uint8), pg)
    scale_work = None
    if q.scale_inv.numel() != 1:
        scale, scale_work = start_all_gather(q.scale_inv, pg)

    def finish() -> Quantized:
        work.wait()
        if scale_work is None:
            return Quantized(data.view(q.data.dtype), q.scale_inv)
        scale_work.wait()
        return Quantized(data.view(q.data.dtype), scale)

    return finish
