"""The dispatch table: for every fused op, an ordered list of implementations, each with a
capability check. The first capable one is chosen when a program is compiled, and
``Program.fusions[i].impl`` records it.

The table itself is written out in :mod:`opfuse.backend.table` (one readable list per op).
``OPFUSE_FORCE_IMPL`` / ``config.force_impl`` forces a choice: ``"impl"`` for every op that
has an implementation of that name, or ``"op=impl,op2=impl2"``. A forced implementation that is
not capable raises :class:`ImplementationError` (forcing is for tests and benchmarks, where a
silent fallback would measure the wrong thing).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch

from ..config import config
from ..ops.base import TensorMeta

__all__ = ["CallSpec", "Implementation", "Choice", "ImplementationError", "choose", "get", "implementations",
           "register_implementation"]


class ImplementationError(RuntimeError):
    """No implementation can run a fused op, or a forced one cannot."""


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """What an implementation's capability check sees: the fused op's inputs and settings."""

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


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to run a fused op.

    ``check(spec)`` returns ``None`` when capable, else a short reason ("dtype float64 not
    supported"). ``forward``/``backward`` signatures are fixed per op (see the op's module).
    """

    name: str
    check: Callable[[CallSpec], str | None]
    forward: Callable[..., Any]
    backward: Callable[..., Any] | None = None
    description: str = ""


@dataclasses.dataclass(frozen=True)
class Choice:
    impl: Implementation
    skipped: tuple[tuple[str, str], ...]

    @property
    def name(self) -> str:
        return self.impl.name


_TABLE: dict[str, list[Implementation]] | None = None


def _table() -> dict[str, list[Implementation]]:
    global _TABLE
    if _TABLE is None:
        from .table import builtin_table

        _TABLE = builtin_table()
    return _TABLE


def implementations(op: str) -> list[Implementation]:
    table = _table()
    if op not in table:
        raise ImplementationError(f"no fused op {op!r} in the dispatch table; known: {sorted(table)}")
    return list(table[op])


def register_implementation(op: str, impl: Implementation, *, first: bool = True) -> None:
    """Add ``impl`` to ``op``'s list (tried first by default, so user kernels win)."""
    table = _table()
    items = table.setdefault(op, [])
    if any(i.name == impl.name for i in items):
        raise ImplementationError(f"{op}: an implementation named {impl.name!r} is registered already")
    if first:
        items.insert(0, impl)
    else:
        items.append(impl)


def get(op: str, name: str) -> Implementation:
    for impl in implementations(op):
        if impl.name == name:
            return impl
    raise ImplementationError(f"{op}: no implementation {name!r}; known: {[i.name for i in implementations(op)]}")


def _forced(op: str) -> str | None:
    text = config.force_impl.strip()
    if not text:
        return None
    if "=" not in text:
        names = {i.name for i in implementations(op)}
        return text if text in names else None
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key.strip() == op:
            return value.strip()
    return None


def choose(spec: CallSpec) -> Choice:
    """The first capable implementation of ``spec.op`` (or the forced one)."""
    forced = _forced(spec.op)
    skipped = []
    for impl in implementations(spec.op):
        if forced is not None and impl.name != forced:
            continue
        reason = impl.check(spec)
        if reason is None:
            return Choice(impl, tuple(skipped))
        if forced is not None:
            raise ImplementationError(f"{spec.op}: forced implementation {forced!r} cannot run: {reason}")
        skipped.append((impl.name, reason))
    if forced is not None:
        raise ImplementationError(
            f"{spec.op}: forced implementation {forced!r} does not exist; known: "
            f"{[i.name for i in implementations(spec.op)]}"
        )
    detail = "; ".join(f"{n}: {r}" for n, r in skipped)
    raise ImplementationError(f"{spec.op}: no capable implementation ({detail})")
