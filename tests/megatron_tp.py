"""Megatron's two tensor-parallel autograd functions, written by hand as models without DTensor
write them, for the compile front end's tests: :class:`CopyToTP` (``f``: identity forward,
all-reduce of the gradient, before a column-parallel layer) and :class:`ReduceFromTP` (``g``:
all-reduce forward, identity backward, after a row-parallel layer)."""

import torch
import torch.distributed._functional_collectives as funcol


class CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient (a column-parallel layer's input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_reduce(grad.contiguous(), "sum", ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (a row-parallel layer's partial sums); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return funcol.all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None
