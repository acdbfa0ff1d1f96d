"""One registry API for the named things opfuse keeps in order and lets users switch off: fusion
rules (:class:`~.rule.RuleRegistry`), graph passes (:class:`~.graph_pass.PassRegistry`) and the
torch.compile recognizers (:class:`~.recognizer.RecognizerRegistry`).

A :class:`Registry` holds entries that have a ``name``. Every registry answers the same calls:
:meth:`~Registry.add` (``replace=`` to swap an entry), :meth:`~Registry.remove`,
:meth:`~Registry.get`, :meth:`~Registry.names`, :meth:`~Registry.ordered` (the order they are
used in), :meth:`~Registry.is_disabled` (why an entry is off), :meth:`~Registry.active` (what a
compile uses now) and :meth:`~Registry.disabled` (a context manager switching entries off).
``generation`` grows whenever what is active may have changed (compile caches key on it) and every
change bumps :mod:`opfuse.epoch` (the per-call guard of compiled blocks).

A subclass says what its entries are called (``kind``: ``"rule"``, messages say
``register_rule`` / ``remove_rule`` / ``disabled_rules``), which setting lists entries disabled
globally (``setting``, a field of ``opfuse.config``), what a valid entry is (:meth:`_validate`),
how entries are ordered (:meth:`_order`) and which error type its messages raise (``error``).
"""

from __future__ import annotations

import contextlib
import difflib
from typing import Generic, Iterator, Sequence, TypeVar

from .. import epoch
from ..config import config, env_name

__all__ = ["Registry", "RegistryError"]

T = TypeVar("T")


class RegistryError(ValueError):
    """A registry refused an entry, a name or a placement (subclasses raise their own type)."""


class Registry(Generic[T]):
    """Named entries in an order, each switchable off in a scope or by a setting (module docstring)."""

    #: What an entry is called in messages (``register_<kind>``, ``remove_<kind>``, ...).
    kind = "entry"
    #: Its plural (``disabled_<plural>``).
    plural = "entries"
    #: The ``opfuse.config`` field listing names that never run (``None``: no such setting).
    setting: str | None = None
    #: The exception type of this registry's messages.
    error: type[Exception] = RegistryError
    #: Where users find ``register_<kind>`` and ``disabled_<kind>s`` (shown in reasons).
    api_module = "opfuse.passes"

    def __init__(self, initial: Sequence[T] = ()):
        self._entries: dict[str, T] = {}
        self._disabled: list[str] = []
        self.generation = 0
        for entry in initial:
            self.add(entry)

    # What a subclass decides ------------------------------------------------------------------

    def _validate(self, entry: T) -> None:
        """Raise ``self.error`` naming what is wrong with ``entry`` (default: accept it)."""

    def _order(self, entries: list[T]) -> list[T]:
        """The entries in the order they are used (default: registration order)."""
        return entries

    def _check_removable(self, entry: T) -> None:
        """Raise when ``entry`` may not be removed (default: any entry may)."""

    def _check_disable(self, what: str, names: Sequence[str]) -> None:
        """Raise when ``names`` cannot be disabled (default: unknown names)."""
        unknown = [name for name in names if name not in self._entries]
        if unknown:
            raise self._unknown(what, unknown)

    def _unknown(self, what: str, names) -> Exception:
        """The error for a name (or names) this registry does not hold, with the closest known name."""
        if isinstance(names, str):
            close = difflib.get_close_matches(names, self.names(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return self.error(f"{what}: no {self.kind} named {names!r}{hint}; known: {', '.join(self.names())}")
        return self.error(f"{what}: unknown {self.kind}(s) {list(names)}; known: {', '.join(self.names())}")

    def _duplicate(self, existing: T, entry: T) -> Exception:
        name = getattr(entry, "name")
        return self.error(f"register_{self.kind}: a {self.kind} named {name!r} exists; pass replace=True or "
                          f"remove_{self.kind}({name!r}) first")

    # Reading ----------------------------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: str) -> T:
        """The entry called ``name`` (``KeyError`` naming the known ones otherwise)."""
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"no {self.kind} named {name!r}; known: {', '.join(self.names())}") from None

    def ordered(self) -> list[T]:
        """Every entry, in the order they are used."""
        return self._order(list(self._entries.values()))

    def names(self) -> list[str]:
        """The entries' names, in the order they are used."""
        return [getattr(entry, "name") for entry in self.ordered()]

    def is_disabled(self, entry: T) -> str | None:
        """Why ``entry`` does not run, or ``None``."""
        name = getattr(entry, "name")
        if name in self._disabled:
            return f"disabled by {self.api_module}.{self._scope_api()}(...)"
        if self.setting is not None and name in getattr(config, self.setting):
            return f"disabled by {self._setting_label()}"
        return None

    def _scope_api(self) -> str:
        """The public name of :meth:`disabled` (shown when it switched an entry off)."""
        return f"disabled_{self.plural}"

    def _setting_label(self) -> str:
        return f"{env_name(self.setting)} / config.{self.setting}"

    def active(self) -> list[T]:
        """The entries a compile uses now, in order. Names in the ``setting`` must be known (a
        misspelt name would silently keep an entry on)."""
        if self.setting is not None:
            self._check_disable(self._setting_label(), getattr(config, self.setting))
        return [entry for entry in self.ordered() if self.is_disabled(entry) is None]

    # Changing ---------------------------------------------------------------------------------

    def _changed(self) -> None:
        self.generation += 1
        epoch.bump()

    def add(self, entry: T, *, replace: bool = False) -> T:
        """Validate and register ``entry`` (``replace=True`` swaps an entry of the same name)."""
        self._validate(entry)
        name = getattr(entry, "name")
        if name in self._entries and not replace:
            raise self._duplicate(self._entries[name], entry)
        self._entries[name] = entry
        self._changed()
        return entry

    def remove(self, name: str) -> T:
        """Unregister the entry called ``name`` and return it."""
        if name not in self._entries:
            raise self._unknown(f"remove_{self.kind}", name)
        self._check_removable(self._entries[name])
        entry = self._entries.pop(name)
        self._changed()
        return entry

    @contextlib.contextmanager
    def disabled(self, *names: str) -> Iterator[None]:
        """Context manager: the entries ``names`` do not run inside the block."""
        self._check_disable(self._scope_api(), names)
        self._disabled.extend(names)
        self._changed()
        try:
            yield
        finally:
            for name in names:
                self._disabled.remove(name)
            self._changed()
