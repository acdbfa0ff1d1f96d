"""Base class of the modules that replace matched ops in a program.

A fused module holds references to the matched ops' parameters (shared, so optimizers and
``state_dict`` of the user's block keep working), builds a :class:`CallSpec` from its input
metadata, asks the dispatch table for an implementation when the program is compiled, and calls
its ``torch.library`` custom op with that implementation's name.
"""

from __future__ import annotations

from typing import ClassVar, Sequence

import torch
from torch import nn

from .. import dispatch
from ...ops.base import Described, TensorMeta

__all__ = ["FusedOp", "FusedCall"]


class FusedOp(Described, nn.Module):
    #: Key of this op in the dispatch table.
    op_name: ClassVar[str] = ""

    def __init__(self):
        super().__init__()
        self.impl: str | None = None
        self.skipped: tuple[tuple[str, str], ...] = ()

    def call_spec(self, metas: Sequence[TensorMeta]) -> dispatch.CallSpec:
        raise NotImplementedError

    def select_implementation(self, metas: Sequence[TensorMeta]) -> dispatch.Choice:
        """Choose (and remember) the implementation for inputs with ``metas``."""
        choice = dispatch.choose(self.call_spec(metas))
        self.impl = choice.name
        self.skipped = choice.skipped
        return choice

    def _impl(self) -> str:
        if self.impl is None:
            raise RuntimeError(f"{self.kind}: no implementation selected; compile the program first")
        return self.impl


def _must_use_custom_op(args) -> bool:
    """Under torch.compile, or with fake/functional/proxy tensors, the registered custom op (with
    its fake implementation) must run; plain eager calls take the direct path."""
    if torch.compiler.is_compiling():
        return True
    return any(isinstance(a, torch.Tensor) and type(a) not in (torch.Tensor, torch.nn.Parameter) for a in args)


class FusedCall:
    """A fused op both as a ``torch.library`` custom op and as a direct eager call.

    The custom op (schema inferred from ``fn``'s annotations, a fake implementation, an autograd
    registration) is what torch.compile and fake-tensor tracing see. In eager mode going through
    the dispatcher's Python custom-op path costs tens of microseconds per call (measured with
    ``bench/host_overhead.py``), which decode-size blocks cannot afford, so eager calls run ``fn``
    directly, wrapped in an equivalent ``autograd.Function`` when gradients are needed. Both paths
    share ``fn``, ``setup_context`` and ``backward``.
    """

    def __init__(self, qualname: str, fn, fake, setup_context=None, backward=None):
        self.fn = fn
        self.op = torch.library.custom_op(qualname, mutates_args=())(fn)
        self.op.register_fake(fake)
        self._function = None
        if backward is not None:
            self.op.register_autograd(backward, setup_context=setup_context)

            class _Eager(torch.autograd.Function):
                @staticmethod
                def forward(ctx, *args):
                    out = fn(*args)
                    setup_context(ctx, args, out)
                    return out

                @staticmethod
                def backward(ctx, *grads):
                    return backward(ctx, *grads)

            _Eager.__name__ = _Eager.__qualname__ = qualname.split("::")[-1] + "_eager"
            self._function = _Eager

    def __call__(self, *args):
        if _must_use_custom_op(args):
            return self.op(*args)
        if self._function is not None and torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return self._function.apply(*args)
        return self.fn(*args)
