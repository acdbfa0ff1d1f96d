"""What an implementation of a fused op is, how one is chosen, and a family's table of them.

Nothing here imports an implementation. Each fused-op family lists its implementations in its
``implementations.py`` (an :class:`ImplementationTable`); :mod:`opfuse.core.dispatch` finds every
family's table through the one list of families.

Choosing (:func:`choose`), in program order on every rank:

1. ``check(spec)`` of each implementation in table order: pure (reads shapes, settings, cached
   device and pool state; never allocates, never talks to other ranks); ``None`` or a reason.
2. ``prepare(spec)`` of the first capable one only: reservations, initialisation, barriers.
   Every rank runs the same checks on the same specs, so every rank prepares the same thing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .. import log
from ..ops.base import ImplementationError, TensorMeta

__all__ = ["CallSpec", "Implementation", "Choice", "ImplementationError", "forced_for", "VaryingSize", "VaryingSizeError",
           "fixed_sizes", "choose", "always", "ImplementationTable"]


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


def always(spec: CallSpec) -> None:
    """The check of an implementation that runs everywhere (the references)."""
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


def forced_for(op: str, impls: Sequence[Implementation], forced: Mapping[str | None, str]) -> str | None:
    """The implementation of ``op`` that ``forced`` (``config.parse_force_impl``'s result) names: its
    own entry, else a bare name (key None) where ``op`` has an implementation of that name (a bare
    name forces every op that has it, and leaves the others to choose)."""
    if op in forced:
        return forced[op]
    want = forced.get(None)
    return want if want in {impl.name for impl in impls} else None


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


#: ``(spec, implementations in table order) -> implementations in the order to try``.
Reorder = Callable[[CallSpec, Sequence[Implementation]], list[Implementation]]


class ImplementationTable:
    """A family's fused ops and, for each, its implementations in the order they are tried.

    The last implementation of every op is ``reference`` (torch ops and ``torch.distributed``: it
    runs anywhere, CPU and gloo included), so every op always has a capable one. An op in
    ``measured_order`` is reordered per call by a pure function of the call and the table order
    (measurements per GPU kind and size class).

    Examples
    --------
    >>> TABLE = ImplementationTable("bias_gelu", {"bias_gelu": [
    ...     Implementation("reference", always, forward, backward)]})   # doctest: +SKIP
    >>> TABLE.get("bias_gelu", "reference").forward                        # doctest: +SKIP
    """

    def __init__(self, family: str, table: Mapping[str, Sequence[Implementation]],
                 measured_order: Mapping[str, Reorder] | None = None):
        self.family = family
        self._table: dict[str, list[Implementation]] = {}
        for op, impls in table.items():
            names = [impl.name for impl in impls]
            if not names or names[-1] != "reference":
                raise ImplementationError(f"family {family}: fused op {op!r} has implementations {names}; the last "
                                          f"must be 'reference' (torch ops, runs anywhere)")
            if len(set(names)) != len(names):
                raise ImplementationError(f"family {family}: fused op {op!r} names an implementation twice: {names}")
            self._table[op] = list(impls)
        unknown = sorted(set(measured_order or {}) - set(self._table))
        if unknown:
            raise ImplementationError(f"family {family}: measured_order names unknown fused op(s) {unknown}; "
                                      f"its fused ops: {self.ops()}")
        #: Fused op -> its :data:`Reorder` (tests replace entries).
        self.measured_order: dict[str, Reorder] = dict(measured_order or {})

    def ops(self) -> list[str]:
        """The family's fused ops, in table order."""
        return list(self._table)

    def __contains__(self, op: str) -> bool:
        return op in self._table

    def _impls(self, op: str) -> list[Implementation]:
        try:
            return self._table[op]
        except KeyError:
            raise ImplementationError(f"no fused op {op!r} in family {self.family}; its fused ops: "
                                      f"{self.ops()}") from None

    def for_op(self, op: str, spec: CallSpec | None = None) -> list[Implementation]:
        """``op``'s implementations in the order tried: the table's, or for a call (``spec``) of an
        op in :attr:`measured_order`, the measured order of the running GPU and size class."""
        impls = self._impls(op)
        reorder = self.measured_order.get(op)
        return list(impls) if spec is None or reorder is None else reorder(spec, impls)

    def get(self, op: str, name: str) -> Implementation:
        """Implementation ``name`` of ``op`` (what a custom op runs for the ``impl`` it was given)."""
        for impl in self._impls(op):
            if impl.name == name:
                return impl
        raise ImplementationError(f"{op}: no implementation {name!r}; known: {sorted(self.names()[op])}")

    def names(self) -> dict[str, list[str]]:
        """``{fused op: [implementation names in order]}``."""
        return {op: [impl.name for impl in impls] for op, impls in self._table.items()}

    def add(self, op: str, impl: Implementation, *, before: str = "reference") -> Implementation:
        """Insert ``impl`` into ``op``'s list just before implementation ``before`` (the reference by
        default, which stays last). Raises :class:`ImplementationError` for an unknown op or
        anchor, a name the op already has, or an object that is not an :class:`Implementation`."""
        impls = self._impls(op)
        if not isinstance(impl, Implementation):
            raise ImplementationError(f"{op}: expected an opfuse Implementation, got {type(impl).__name__}")
        names = [i.name for i in impls]
        if impl.name in names:
            raise ImplementationError(f"{op}: an implementation named {impl.name!r} exists; implementations: {names}")
        if before not in names:
            raise ImplementationError(f"{op}: before={before!r} is not one of its implementations {names}")
        impls.insert(names.index(before), impl)
        return impl

    def remove(self, op: str, name: str) -> Implementation:
        """Take implementation ``name`` out of ``op``'s list (the reference stays)."""
        impl = self.get(op, name)
        if name == "reference":
            raise ImplementationError(f"{op}: the reference implementation cannot be removed (it always runs)")
        self._impls(op).remove(impl)
        return impl
