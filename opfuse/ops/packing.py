"""Tensors stored back to back: one GEMM over several weights without copying them.

Several weights ``[n_i, k]`` that lie one after the other in one storage *are* the rows of one
``[sum n_i, k]`` matrix. :func:`join_rows` returns that matrix as a view, differentiably: the
gradient of the joined matrix is split back into the gradient of each original tensor, so a
fused GEMM trains the user's own parameters. :func:`pack_rows_` moves parameters into one
buffer so that they are adjacent (``ops.GatedLinear`` keeps its gate and up weights that way).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["adjacent", "join_rows", "pack_rows_", "span_key", "storage_address"]


def adjacent(tensors: Sequence[torch.Tensor]) -> bool:
    """True when ``tensors`` (contiguous, same dtype, device and trailing shape) follow one
    another in one storage, in this order: their rows form one contiguous matrix. Meta and fake
    tensors (stand-ins, tracing) are compared by storage and offset."""
    first = tensors[0]
    if first.dim() == 0 or not first.is_contiguous():
        return False
    for t in tensors[1:]:
        if (t.dtype != first.dtype or t.device != first.device or t.shape[1:] != first.shape[1:]
                or not t.is_contiguous()):
            return False
    span = _span(first)
    if span is None:
        return False
    storage, end = span[0], span[1] + first.numel()
    for t in tensors[1:]:
        span = _span(t)
        if span is None or span[0] != storage or span[1] != end:
            return False
        end += t.numel()
    return True


def _span(t: torch.Tensor) -> tuple | None:
    """``(storage identity, first element)`` of ``t``: its storage's address for tensors with
    memory, the storage object for meta and fake ones."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if t.is_meta or _is_fake(t):
        return ("storage", storage._cdata), t.storage_offset()
    try:
        return ("address", storage.data_ptr()), t.storage_offset()
    except (RuntimeError, NotImplementedError):
        return None


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def storage_address(t: torch.Tensor | None) -> int | None:
    """The address of ``t``'s storage (``None`` for ``None`` or a tensor without memory): tensors
    stored back to back share it, so it tells one buffer from another at the same addresses."""
    if t is None:
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def span_key(t: torch.Tensor):
    """A sort key that orders tensors of one storage by where they start (``None`` if unknown)."""
    span = _span(t)
    return None if span is None else (span[0][1], span[1])


def _tracing(tensors) -> bool:
    if torch.compiler.is_compiling():
        return True
    return any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors)


class _JoinRows(torch.autograd.Function):
    """The rows of adjacent tensors as one view; backward splits the gradient."""

    @staticmethod
    def forward(ctx, *tensors):
        ctx.sizes = [t.shape[0] for t in tensors]
        first = tensors[0]
        return first.as_strided((sum(ctx.sizes),) + tuple(first.shape[1:]), first.stride(), first.storage_offset())

    @staticmethod
    def backward(ctx, grad):
        return tuple(grad.split(ctx.sizes))


def join_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors)`` along dim 0, without a copy when the tensors are :func:`adjacent`.

    Differentiable either way (each tensor gets its slice of the gradient). Tensors that are not
    adjacent, and traced calls (``torch.compile``, fake tensors), are concatenated.

    Examples
    --------
    >>> buf = torch.randn(6, 4)
    >>> a, b = torch.nn.Parameter(buf[:2]), torch.nn.Parameter(buf[2:])
    >>> join_rows([a, b]).data_ptr() == a.data_ptr()
    True
    """
    tensors = list(tensors)
    if len(tensors) == 1:
        return tensors[0]
    if all(_is_fake(t) for t in tensors) and not torch.is_grad_enabled():
        # Fake tensors with grad off: opfuse lowering a fused op into a graph autograd already
        # differentiated (torch.compile). Adjacent inputs are joined as a view of their storage.
        if adjacent(tensors):
            first = tensors[0]
            return first.as_strided((sum(t.shape[0] for t in tensors),) + tuple(first.shape[1:]), first.stride(),
                                    first.storage_offset())
        return torch.cat(tensors)
    if _tracing(tensors):
        return torch.cat(tensors)
    if not adjacent(tensors):
        return torch.cat(tensors)
    return _JoinRows.apply(*tensors)


def pack_rows_(tensors: Sequence[torch.Tensor]) -> None:
    """Move ``tensors`` (parameters or tensors of one dtype, device and trailing shape) into one
    new buffer, in this order, so that they become :func:`adjacent`. Values are kept; the tensor
    objects stay the same (``.data`` is re-pointed, as Megatron-LM's contiguous parameter buffers
    do), so optimizers and ``state_dict`` keep working. A no-op when they are adjacent already."""
    tensors = list(tensors)
    if len(tensors) < 2 or adjacent(tensors):
        return
    first = tensors[0]
    for t in tensors[1:]:
        if t.dtype != first.dtype or t.device != first.device or t.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"pack_rows_: tensors differ in dtype, device or trailing shape ({first.dtype} {first.device} "
                f"{list(first.shape)} vs {t.dtype} {t.device} {list(t.shape)}); only alike tensors share rows")
    if first.device.type == "meta":
        return
    with torch.no_grad():
        buffer = torch.empty((sum(t.shape[0] for t in tensors),) + tuple(first.shape[1:]), dtype=first.dtype,
                             device=first.device)
        start = 0
        for t in tensors:
            part = buffer[start:start + t.shape[0]]
            part.copy_(t)
            t.data = part
            start += t.shape[0]
