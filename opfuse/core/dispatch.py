"""The dispatch table: every fused op's implementations in the order they are tried, found through
the one list of families (each family's ``implementations.py``; nothing registers itself on import).

A program's ``select_implementations`` pass takes the first capable implementation of each fused op
(:func:`opfuse.machinery.implementation.choose`) and records it in ``Program.fusions``; the
reference implementation at the end of each list always runs (torch ops + ``torch.distributed``,
CPU and gloo included). The order follows measurements (docs/PERF_NOTES*.md); an op with a measured
order is reordered per call from measurements per GPU kind and size class. Users add an
implementation to an existing fused op with :func:`register_implementation` (docs/EXTENDING.md).
"""

from __future__ import annotations

from .. import epoch
from ..families import FAMILIES
from ..machinery.implementation import CallSpec, Implementation, ImplementationError, ImplementationTable

__all__ = ["table", "for_op", "get", "names", "register_implementation", "remove_implementation", "add_table",
           "remove_table", "generation"]


def _owners() -> dict[str, ImplementationTable]:
    owners: dict[str, ImplementationTable] = {}
    for family in FAMILIES:
        for op in family.implementations.ops():
            if op in owners:
                raise ImplementationError(f"fused op {op!r} is defined by families {owners[op].family} and "
                                          f"{family.name}: one name per fused op")
            owners[op] = family.implementations
    return owners


_OWNERS = _owners()
_generation = 0


def table(op: str) -> ImplementationTable:
    """The implementation table of the family that defines fused op ``op``."""
    try:
        return _OWNERS[op]
    except KeyError:
        raise ImplementationError(f"no fused op {op!r} in the implementation table; known: {sorted(_OWNERS)}") from None


def for_op(op: str, spec: CallSpec | None = None) -> list[Implementation]:
    """``op``'s implementations in the order tried: its family's table order, or for a call
    (``spec``) of an op with a measured order, the measured order of the running GPU and size class."""
    return table(op).for_op(op, spec)


def get(op: str, name: str) -> Implementation:
    """Implementation ``name`` of ``op``."""
    return table(op).get(op, name)


def names() -> dict[str, list[str]]:
    """``{fused op: [implementation names in order]}`` (for ``doctor`` and setting validation)."""
    return {op: owner.names()[op] for op, owner in _OWNERS.items()}


def generation() -> int:
    """Changes whenever an implementation is registered or removed (compile caches key on it)."""
    return _generation


def _changed() -> None:
    global _generation
    _generation += 1
    epoch.bump()  # compiled blocks chose among the old implementations


def register_implementation(op: str, impl: Implementation, *, before: str = "reference") -> Implementation:
    """Add ``impl`` to fused op ``op``'s implementations, tried just before ``before`` (by default
    the reference, which stays last). Blocks compile again on their next call.

    Examples
    --------
    >>> register_implementation("add_rmsnorm", Implementation("mine", check, forward, backward),
    ...                         before="cuda")        # doctest: +SKIP
    """
    table(op).add(op, impl, before=before)
    _changed()
    return impl


def remove_implementation(op: str, name: str) -> Implementation:
    """Take implementation ``name`` (one registered with :func:`register_implementation`, or a
    built-in one other than the reference) out of ``op``'s list."""
    impl = table(op).remove(op, name)
    _changed()
    return impl


def add_table(implementations: ImplementationTable) -> None:
    """Add the fused ops of a family defined outside opfuse (``opfuse.register_family``); a name
    that is already a fused op is an error (one name per fused op)."""
    taken = [op for op in implementations.ops() if op in _OWNERS]
    if taken:
        raise ImplementationError(f"family {implementations.family}: fused op(s) {taken} exist already (defined by "
                                  f"{sorted({_OWNERS[op].family for op in taken})}); one name per fused op")
    _OWNERS.update({op: implementations for op in implementations.ops()})
    _changed()


def remove_table(implementations: ImplementationTable) -> None:
    """Take the fused ops of an added family out again."""
    for op in implementations.ops():
        if _OWNERS.get(op) is implementations:
            del _OWNERS[op]
    _changed()
