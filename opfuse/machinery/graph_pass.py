"""Graph passes as data: a name, a function ``fn(graph_module, ctx)``, where it was defined, and
where it runs; and :class:`PassRegistry`, the ordered pipeline of built-in and registered passes.

Machinery only: the built-in passes and the process-wide registry are in
:mod:`opfuse.core.pipeline`.

Placement. The built-in passes run in a fixed order. A registered pass names an anchor (a
built-in pass or an earlier registered one): ``after=A`` runs it after ``A`` and after the passes
already placed after ``A``; ``before=B`` runs it just before ``B`` (after the passes already
placed before ``B``); with both, the ``after`` placement must also come before ``B``. Passes
placed at the same point run in registration order.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Callable, Sequence

from torch import fx

from .registry import Registry

__all__ = ["Pass", "PassError", "PassRegistry", "generation", "function_location"]

_generation = 0


def generation() -> int:
    """Bumped whenever any pass registry's pipeline may have changed (compile caches key on it)."""
    return _generation


class PassError(RuntimeError):
    """A malformed or misplaced pass (at registration), or a pass that failed while compiling."""


def function_location(fn: Callable, fallback: str) -> str:
    """``file:line`` where ``fn`` is defined (relative to the working directory when below it)."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return fallback
    path = os.path.relpath(code.co_filename)
    if path.startswith(".."):
        path = code.co_filename
    return f"{path}:{code.co_firstlineno}"


@dataclasses.dataclass(frozen=True)
class Pass:
    """A graph pass: ``run(graph_module, ctx)`` edits the graph in place.

    ``builtin`` passes are opfuse's own pipeline stages; ``required`` ones cannot be disabled
    (the program cannot run without them). ``after`` / ``before`` are the anchors of a
    registered pass.
    """

    name: str
    run: Callable[[fx.GraphModule, object], None]
    source: str = "?"
    builtin: bool = False
    required: bool = False
    after: str | None = None
    before: str | None = None

    def __repr__(self) -> str:
        where = f"after={self.after!r}" if self.after else (f"before={self.before!r}" if self.before else "built-in")
        return f"Pass({self.name!r}, {where}, at {self.source})"


def _check_name(name) -> None:
    if not isinstance(name, str) or not name or not name.replace("-", "_").isidentifier():
        raise PassError(f"register_pass: name={name!r}; expected a non-empty identifier-like string")


def _check_callable(name: str, fn) -> None:
    if not callable(fn):
        raise PassError(f"register_pass: pass {name!r}: {fn!r} is not callable; a pass is fn(graph_module, ctx)")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise PassError(f"register_pass: pass {name!r}: {getattr(fn, '__name__', fn)}{inspect.signature(fn)} cannot "
                        f"be called as fn(graph_module, ctx)") from None
    except ValueError:  # builtins without a signature
        pass


class PassRegistry(Registry[Pass]):
    """The built-in passes in their fixed order plus registered passes at their anchors; the one
    registry API (:class:`~.registry.Registry`) with ``register_pass`` / ``remove_pass`` /
    ``disabled_passes`` messages and ``OPFUSE_DISABLE_PASSES``."""

    kind = "pass"
    plural = "passes"
    setting = "disabled_passes"
    error = PassError

    def __init__(self, builtins: Sequence[Pass]):
        self._builtins = list(builtins)
        self._placed: list[Pass] | None = None
        super().__init__()
        self._entries.update({p.name: p for p in self._builtins})

    # Order --------------------------------------------------------------------------------

    def _registered(self) -> dict[str, Pass]:
        return {name: p for name, p in self._entries.items() if not p.builtin}

    def _follows(self, item: Pass, anchor: str) -> bool:
        """True when registered pass ``item`` is placed (transitively) after ``anchor``."""
        registered = self._registered()
        seen = set()
        while not item.builtin and item.name not in seen:
            seen.add(item.name)
            nxt = item.after or item.before
            if item.after == anchor:
                return True
            if nxt is None or nxt not in registered:
                return False
            item = registered[nxt]
        return False

    def _place(self, registered: Sequence[Pass]) -> list[Pass]:
        order = list(self._builtins)
        for item in registered:
            names = [p.name for p in order]
            if item.after is not None:
                index = names.index(item.after) + 1
                while index < len(order) and self._follows(order[index], item.after):
                    index += 1
            else:
                index = names.index(item.before)
            order.insert(index, item)
            if item.after is not None and item.before is not None:
                names = [p.name for p in order]
                if names.index(item.before) < index:
                    raise PassError(
                        f"register_pass: pass {item.name!r}: after={item.after!r} and before={item.before!r} cannot "
                        f"both hold ({item.before!r} runs before {item.after!r}); the pipeline is "
                        f"{' -> '.join(names)}")
        return order

    def _order(self, entries: list[Pass]) -> list[Pass]:
        if self._placed is None:
            self._placed = self._place(list(self._registered().values()))
        return list(self._placed)

    def get(self, name: str) -> Pass:
        for item in self.ordered():
            if item.name == name:
                return item
        raise KeyError(f"no pass named {name!r}; passes: {', '.join(self.names())}")

    # Changes ------------------------------------------------------------------------------

    def _changed(self) -> None:
        global _generation
        _generation += 1
        self._placed = None
        super()._changed()

    def _validate(self, item: Pass) -> None:
        _check_name(item.name)
        _check_callable(item.name, item.run)
        for label, anchor in (("after", item.after), ("before", item.before)):
            if anchor is None:
                continue
            if not isinstance(anchor, str):
                raise PassError(f"register_pass: pass {item.name!r}: {label}={anchor!r}; expected a pass name")
            if anchor == item.name:
                raise PassError(f"register_pass: pass {item.name!r} cannot run {label} itself")
            if anchor not in self._entries:
                raise self._unknown(f"register_pass: pass {item.name!r}: {label}=", anchor)
        if item.after is None and item.before is None:
            raise PassError(f"register_pass: pass {item.name!r} needs after= or before=")
        if item.name not in self._entries:
            self._place([*self._registered().values(), item])  # raises for impossible placements

    def _duplicate(self, existing: Pass, item: Pass) -> PassError:
        return PassError(f"register_pass: a pass named {item.name!r} exists ({'built-in' if existing.builtin else 'registered'} "
                         f"at {existing.source}); remove_pass({item.name!r}) first or choose another name")

    def add(self, item: Pass, *, replace: bool = False) -> Pass:
        """Validate and register ``item`` (raises :class:`PassError` with the reason); a pass is
        never replaced in place (remove it first: passes anchored to it would move)."""
        _check_name(item.name)
        _check_callable(item.name, item.run)
        if item.name in self._entries:
            raise self._duplicate(self._entries[item.name], item)
        return super().add(item)

    def _check_removable(self, item: Pass) -> None:
        if item.builtin:
            raise PassError(f"remove_pass: {item.name!r} is a built-in pass; disable it with "
                            f"disabled_passes({item.name!r}) or OPFUSE_DISABLE_PASSES")
        anchored = [p.name for p in self._registered().values() if item.name in (p.after, p.before)]
        if anchored:
            raise PassError(f"remove_pass: pass {item.name!r} is the anchor of {anchored}; remove those first")

    # Disabling ----------------------------------------------------------------------------

    def _check_disable(self, what: str, names: Sequence[str]) -> None:
        for name in names:
            if name not in self._entries:
                raise self._unknown(what, name)
            if self._entries[name].required:
                raise PassError(f"{what}: pass {name!r} cannot be disabled (programs cannot run without it)"
                                + ("; OPFUSE_VERIFY=0 turns its checks off" if name == "verify" else ""))
