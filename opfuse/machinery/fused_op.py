"""What a fused op is, and the one factory that turns a fused op's math into ``torch.library``
custom ops with fakes and autograd.

Nothing here imports an implementation. Each fused-op family (``families/<family>/``) defines its
fused ops with :func:`define_fused_op` and a :class:`FusedOp` subclass, and lists their
implementations in its ``implementations.py`` (:mod:`.implementation`).

One name per fused op (``FusedOp.name``, e.g. ``"allreduce_add_rmsnorm"``): it is the op's kind
in patterns and dumps, its key in the implementation table and in ``OPFUSE_FORCE_IMPL``, and its
custom op (``torch.ops.opfuse.allreduce_add_rmsnorm``; the backward is ``..._backward``).
"""

from __future__ import annotations

import inspect
import typing
from typing import Callable, ClassVar, Sequence

import torch
from torch import nn

from ..ops.base import Described, TensorMeta
from .implementation import CallSpec, Implementation, ImplementationError

__all__ = ["FusedOp", "FusedCall", "define_fused_op", "DIRECT_OVERLOADS", "register_direct_overload",
           "graph_op"]

#: Each fused op's custom op (its ``default`` overload) -> its ``direct`` overload: the same schema,
#: fake and function, registered straight on the dispatcher (no autograd formula, no
#: ``torch.library.custom_op`` wrapper layers). Compiled graphs, whose backward is already traced
#: into the graph, call these (:mod:`opfuse.torch_compile.direct_calls`).
DIRECT_OVERLOADS: dict = {}
_FRAGMENTS: dict[str, torch.library.Library] = {}


class FusedOp(Described, nn.Module):
    """Base class of the modules that replace matched ops in a program.

    A fused module shares the matched ops' parameters (optimizers and ``state_dict`` of the user's
    block keep working), describes a call to the dispatch (:meth:`call_spec`), and runs the
    implementation the program chose (``self.implementation``).
    """

    #: The one name of this fused op (kind, table key, custom op, force key).
    name: ClassVar[str] = ""
    #: In a joint forward + backward graph (torch.compile training), the backward already in the
    #: graph runs this op's chosen implementation too, so the choice is made as for training
    #: (``CallSpec.requires_grad``) although the op itself runs without autograd there.
    backward_follows_implementation: ClassVar[bool] = False
    #: Its reference implementation runs the very ops the fusion covers (no merged GEMM, no
    #: collective saved): where Inductor compiles the graph, Inductor's code for those ops is as
    #: good or better, so a fusion that only the reference could run is left to it
    #: (``opfuse.config.reference_fusions``, :mod:`opfuse.torch_compile.reference_fusions`).
    reference_is_unfused: ClassVar[bool] = False
    #: Its reference does worse than the graph it replaces on any device (a collective in line where
    #: the graph's ran asynchronously): with Inductor, a fusion only the reference could run is left
    #: unfused on CPUs too (``reference_fusions=auto`` otherwise leaves them on CUDA devices only).
    reference_is_slower: ClassVar[bool] = False
    #: Inductor fuses the very ops this fusion covers into one generated kernel of its own (an add +
    #: norm with no collective): the fused kernel saves no memory pass over Inductor's, while a
    #: custom op costs host time per call that an Inductor kernel launch does not. Where Inductor
    #: compiles the graph, the fusion is left to it whatever implementation could run it
    #: (``opfuse.config.reference_fusions``; measured in docs/PERF_NOTES.model.md, session 25).
    inductor_fuses_alike: ClassVar[bool] = False

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
        self.direct = register_direct_overload(self.op, fn, fake)
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


def register_direct_overload(op, fn, fake):
    """Register ``<op>.direct`` for custom op ``op`` (a ``torch.library.custom_op``): ``op``'s
    schema with ``fn`` as its kernel for every backend and ``fake`` as its fake, and list it in
    :data:`DIRECT_OVERLOADS` so compiled graphs call it. Through ``torch.library.custom_op`` a call
    passes the autograd wrapper, a redispatch, the backend wrapper with its alias check and a
    Dynamo-disable frame; registered directly, the dispatcher calls ``fn`` (host cost per call:
    docs/PERF_NOTES.md, "Host overhead of a compiled block"). Only for graphs past autograd: the
    overload has no autograd formula. The alias check's guarantee is kept by :func:`_distinct`
    (no input returned, no tensor returned twice) unless ``fn`` is marked ``_opfuse_distinct``."""
    kernel = fn if getattr(fn, "_opfuse_distinct", False) else (lambda *args: _distinct(fn(*args), args))
    namespace, name = op._qualname.split("::")
    lib = _FRAGMENTS.get(namespace)
    if lib is None:
        lib = _FRAGMENTS[namespace] = torch.library.Library(namespace, "FRAGMENT")
    schema = str(op._opoverload._schema)
    lib.define(f"{name}.direct{schema[schema.index('('):]}")
    lib.impl(f"{name}.direct", kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{namespace}::{name}.direct", fake, lib=lib)
    direct = getattr(getattr(torch.ops, namespace), name).direct
    DIRECT_OVERLOADS[op._opoverload] = direct
    return direct


def graph_op(qualname: str, fake: Callable):
    """Decorator: the function becomes custom op ``qualname`` (no mutated arguments, ``fake`` as
    its fake) with a ``direct`` overload (:func:`register_direct_overload`). For ops that only
    lowering passes write into graphs already differentiated (no autograd formula): Dynamo and
    AOTAutograd never trace them, and the compiled graph calls the direct overload."""

    def wrap(fn):
        op = torch.library.custom_op(qualname, mutates_args=())(fn)
        op.register_fake(fake)
        register_direct_overload(op, fn, fake)
        return op

    return wrap


def _distinct(result, args):
    """``result`` with no tensor returned twice or returned as it was given: a custom op's outputs
    may not alias its inputs or each other (torch checks it when the op runs through the
    dispatcher), and implementations share one empty placeholder for the gradients nobody asked
    for."""
    if isinstance(result, torch.Tensor):
        return result.clone() if any(result is a for a in args) else result
    if not isinstance(result, (tuple, list)):
        return result
    seen = {id(a) for a in args if isinstance(a, torch.Tensor)}
    out = []
    for item in result:
        if isinstance(item, torch.Tensor):
            if id(item) in seen:
                item = item.new_empty(0) if item.numel() == 0 else item.clone()
            seen.add(id(item))
        out.append(item)
    return type(result)(out)


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
        return _distinct(fn(*args[:-1]), args)

    run._opfuse_distinct = True  # its results never alias its arguments or each other

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
