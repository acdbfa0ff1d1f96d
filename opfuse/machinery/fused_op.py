"""The backend's leaf: what a fused op is, what an implementation is, how one is chosen, and the one
factory that turns a fused op's math into ``torch.library`` custom ops with fakes and autograd.

Nothing here imports an implementation. The ordered implementation lists live in
:mod:`opfuse.core.dispatch`; each fused-op family (``families/<family>/``) defines its
fused ops with :func:`define_fused_op` and a :class:`FusedOp` subclass.

One name per fused op (``FusedOp.name``, e.g. ``"allreduce_add_rmsnorm"``): it is the op's kind
in patterns and dumps, its key in the implementation table and in ``OPFUSE_FORCE_IMPL``, and its
custom op (``torch.ops.opfuse.allreduce_add_rmsnorm``; the backward is ``..._backward``).

Choosing (:func:`choose`), in program order on every rank:

1. ``check(spec)`` of each implementation in table order: pure (reads shapes, settings, cached
   device and pool state; never allocates, never talks to other ranks); ``None`` or a reason.
2. ``prepare(spec)`` of the first capable one only: reservations, initialisation, barriers.
   Every rank runs the same checks on the same specs, so every rank prepares the same thing.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .. import log
from ..ops.base import Described, TensorMeta

__all__ = ["CallSpec", "Implementation", "Choice", "ImplementationError", "VaryingSize", "VaryingSizeError",
           "fixed_sizes", "choose", "FusedOp", "FusedCall", "define_fused_op"]


class ImplementationError(RuntimeError):
    """No implementation can run a fused op, or a forced one cannot."""


class VaryingSizeError(ImplementationError):
    """A check asked for a size that varies between calls of a graph compiled for dynamic shapes
    (the token count of a model run at several sequence lengths)."""


class VaryingSize:
    """A size that differs from call to call (a ``torch.SymInt`` token count), as the checks see
    it. Checks are decisions made once per compiled graph: a check whose answer depends on the
    size (a message-size crossover, a peer buffer's capacity) cannot be answered for every call,
    so any arithmetic or comparison raises :class:`VaryingSizeError` and the implementation is
    skipped with that reason; the next one whose check does not depend on the size runs. Equal
    only to a size of the same expression (two values with the same token count)."""

    __slots__ = ("expr",)

    def __init__(self, size):
        self.expr = size.node.expr if isinstance(size, torch.SymInt) else size

    def _refuse(self, *_):
        raise VaryingSizeError(f"the token count ({self.expr}) varies between calls (a graph compiled for dynamic "
                               f"shapes)")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = __mod__ = __rmod__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = __int__ = __index__ = __float__ = __bool__ = _refuse

    def __eq__(self, other):
        return isinstance(other, VaryingSize) and other.expr == self.expr

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash(("VaryingSize", str(self.expr)))

    def __repr__(self):
        return f"{self.expr}"


def _varying(value):
    """``value`` with every ``torch.SymInt`` in it (tensor metadata, attributes) a :class:`VaryingSize`."""
    if isinstance(value, torch.SymInt):
        constant = value.node.maybe_as_int()
        return VaryingSize(value) if constant is None else constant
    if isinstance(value, TensorMeta):
        if not any(isinstance(size, torch.SymInt) for size in value.shape):
            return value
        return dataclasses.replace(value, shape=tuple(_varying(size) for size in value.shape))
    if isinstance(value, tuple):
        return tuple(_varying(v) for v in value)
    if isinstance(value, list):
        return [_varying(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _varying(v) for k, v in value.items()}
    return value


def fixed_sizes(spec: "CallSpec") -> "CallSpec":
    """``spec`` as the checks see it: sizes that vary between calls become :class:`VaryingSize`."""
    if not _has_symbols(dict(spec.inputs)) and not _has_symbols(dict(spec.attrs)):
        return spec
    return dataclasses.replace(spec, inputs=_varying(dict(spec.inputs)), attrs=_varying(dict(spec.attrs)))


def _has_symbols(value) -> bool:
    if isinstance(value, torch.SymInt):
        return value.node.maybe_as_int() is None
    if isinstance(value, TensorMeta):
        return _has_symbols(value.shape)
    if isinstance(value, (tuple, list)):
        return any(_has_symbols(v) for v in value)
    if isinstance(value, Mapping):
        return any(_has_symbols(v) for v in value.values())
    return False


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """What an implementation's check sees: the fused op's input metadata and settings."""

    op: str
    inputs: Mapping[str, TensorMeta | None]
    attrs: Mapping[str, Any]
    group_name: str | None = None
    world_size: int = 1
    requires_grad: bool = False

    @property
    def x(self) -> TensorMeta:
        return self.inputs["x"]

    @property
    def device(self) -> torch.device:
        return torch.device(self.x.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype


def _prepared(spec: CallSpec) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to run a fused op.

    ``check(spec)`` is pure and returns ``None`` when capable, else a short reason.
    ``prepare(spec)`` runs once per program for the chosen implementation (reserve peer memory,
    initialise it, barrier). ``forward`` / ``backward`` take the fused op's custom-op arguments
    minus the trailing ``impl`` name (see the family's ``op.py``).
    """

    name: str
    check: Callable[[CallSpec], str | None]
    forward: Callable[..., Any]
    backward: Callable[..., Any] | None = None
    prepare: Callable[[CallSpec], None] = _prepared
    description: str = ""


@dataclasses.dataclass(frozen=True)
class Choice:
    impl: Implementation
    skipped: tuple[tuple[str, str], ...]

    @property
    def name(self) -> str:
        return self.impl.name


def choose(spec: CallSpec, impls: Sequence[Implementation], forced: str | None = None) -> Choice:
    """Check ``impls`` in order; prepare and return the first capable one (or the ``forced`` one,
    whose incapability is an error: forcing is for tests and benchmarks, where a silent fallback
    would measure the wrong thing)."""
    if forced is not None and forced not in {i.name for i in impls}:
        raise ImplementationError(
            f"{spec.op}: forced implementation {forced!r} does not exist; known: {[i.name for i in impls]}")
    # Under torch.compile this runs inside the fake-tensor mode of Inductor's joint-graph pass;
    # checks may ask a library about real buffers (cuDNN engine support), and prepare() allocates
    # peer memory and talks to the other ranks: both need real tensors.
    with unset_fake_temporarily():
        return _first_capable(fixed_sizes(spec), impls, forced)


def _first_capable(spec: CallSpec, impls: Sequence[Implementation], forced: str | None) -> Choice:
    skipped = []
    for impl in impls:
        if forced is not None and impl.name != forced:
            continue
        try:
            reason = impl.check(spec)
            if reason is None:
                impl.prepare(spec)
        except VaryingSizeError as error:
            # Chosen once per graph, run at every length: an implementation whose capability
            # depends on the size cannot be chosen here (a size-independent one is, below it).
            reason = f"its check needs a fixed size: {error}"
        if reason is None:
            log.fallback(spec.op, impl.name, skipped)
            return Choice(impl, tuple(skipped))
        if forced is not None:
            raise ImplementationError(f"{spec.op}: forced implementation {forced!r} cannot run: {reason}")
        skipped.append((impl.name, reason))
    detail = "; ".join(f"{n}: {r}" for n, r in skipped)
    raise ImplementationError(f"{spec.op}: no capable implementation ({detail})")


class FusedOp(Described, nn.Module):
    """Base class of the modules that replace matched ops in a program.

    A fused module shares the matched ops' parameters (optimizers and ``state_dict`` of the user's
    block keep working), describes a call to the dispatch (:meth:`call_spec`), and runs the
    implementation the program chose (``self.implementation``).
    """

    #: The one name of this fused op (kind, table key, custom op, force key).
    name: ClassVar[str] = ""

    def __init__(self):
        super().__init__()
        self.implementation: Implementation | None = None
        self.skipped: tuple[tuple[str, str], ...] = ()

    @property
    def kind(self) -> str:
        return self.name

    @property
    def impl(self) -> str | None:
        """Name of the chosen implementation (``None`` before the program selected one)."""
        return None if self.implementation is None else self.implementation.name

    def call_spec(self, metas: Sequence[TensorMeta]) -> CallSpec:
        raise NotImplementedError(f"{type(self).__name__}.call_spec")

    def _impl(self) -> str:
        if self.implementation is None:
            raise RuntimeError(f"{self.kind}: no implementation selected; compile the program first")
        return self.implementation.name


_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter


class FusedCall:
    """A fused op both as a ``torch.library`` custom op and as a direct eager call.

    The custom op (schema from the prototype's annotations, a fake implementation, an autograd
    registration) is what torch.compile and fake-tensor tracing see. Going through the
    dispatcher's Python custom-op path costs tens of microseconds per eager call, which
    decode-size blocks cannot afford, so eager calls run ``fn`` directly, inside an equivalent
    ``autograd.Function`` when gradients are needed. Both paths share ``fn``, ``setup_context`` and
    ``backward``. Under torch.compile, or when the main (first) argument is a fake, functional or
    proxy tensor, the custom op runs.
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
        # Eager calls of small ops are host-bound: decide from the first argument (the op's main
        # tensor; tracing wraps every tensor alike, so a plain one, or a tensor type that marks
        # itself eager such as opfuse.fp8.Float8Activation, means eager) and scan the arguments
        # for requires_grad only when autograd is on.
        cls = args[0].__class__
        if cls is not _TENSOR and cls is not _PARAMETER and not getattr(cls, "_opfuse_eager", False):
            return self.op(*args)  # a fake, functional or proxy tensor: tracing
        if torch.compiler.is_compiling():
            return self.op(*args)
        if self._function is not None and torch.is_grad_enabled():
            for a in args:
                if isinstance(a, _TENSOR) and a.requires_grad:
                    return self._function.apply(*args)
        return self.fn(*args)


def _dispatching(qualname: str, prototype: Callable, lookup: Callable[[str], Implementation], which: str):
    """A function with ``prototype``'s signature (its last parameter is the implementation name)
    that runs ``lookup(impl).<which>`` on the other arguments."""
    hints = typing.get_type_hints(prototype)
    signature = inspect.signature(prototype)
    params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in signature.parameters.values()]
    if not params or params[-1].name != "impl":
        raise TypeError(f"{qualname}: the prototype's last parameter must be 'impl: str' (the implementation name)")

    resolved: dict[str, Callable] = {}  # implementation name -> its function (looked up once)

    def resolve(name: str) -> Callable:
        chosen = lookup(name)
        fn = getattr(chosen, which)
        if fn is None:
            raise ImplementationError(f"{qualname}: implementation {chosen.name!r} has no {which}")
        resolved[name] = fn
        return fn

    def run(*args):
        fn = resolved.get(args[-1])
        if fn is None:
            fn = resolve(args[-1])
        return fn(*args[:-1])

    run.__name__ = qualname.split("::")[-1]
    run.__qualname__ = run.__name__
    run.__module__ = prototype.__module__
    run.__signature__ = signature.replace(parameters=params, return_annotation=hints.get("return"))
    return run


def define_fused_op(name: str, *, lookup: Callable[[str, str], Implementation], forward: Callable, fake: Callable,
                    backward: Callable | None = None, backward_fake: Callable | None = None,
                    setup_context: Callable | None = None,
                    autograd: Callable[[FusedCall | None], Callable] | None = None,
                    dispatch: bool = True) -> tuple[FusedCall, FusedCall | None]:
    """The custom ops of fused op ``name``: ``opfuse::<name>`` and, for a differentiable op,
    ``opfuse::<name>_backward``.

    ``forward`` / ``backward`` are prototypes: typed signatures whose last parameter is
    ``impl: str``; their bodies are not used. A call runs the chosen implementation's
    ``forward`` / ``backward`` (``lookup(name, impl)``) with the other arguments. ``fake`` /
    ``backward_fake`` take the same arguments and return empty tensors of the result shapes.
    ``setup_context`` is ``register_autograd``'s; ``autograd(backward_op)`` returns its backward
    function, which calls the backward op. ``dispatch=False``: ``forward`` / ``backward`` are
    the bodies themselves (a family whose ops do shared work around the implementation call, e.g.
    the FSDP gathers of ``grouped_linear``). Returns ``(forward_op, backward_op or None)``.
    """

    def body(qualname, fn, which):
        return _dispatching(qualname, fn, lambda impl: lookup(name, impl), which) if dispatch else fn

    backward_op = None
    if backward is not None:
        qualname = f"opfuse::{name}_backward"
        backward_op = FusedCall(qualname, body(qualname, backward, "backward"), backward_fake)
    forward_op = FusedCall(f"opfuse::{name}", body(f"opfuse::{name}", forward, "forward"), fake, setup_context,
                           None if autograd is None else autograd(backward_op))
    return forward_op, backward_op
