"""Fusion rules as data: a pattern, predicates, a replacement builder, a priority, and where the rule
was defined; and :class:`RuleRegistry`, an ordered collection of them.

This is machinery only: it knows no rule and no fused op. The built-in rules are in each family's
``rules.py``; the process-wide registry users add to is :mod:`opfuse.core.rules`.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from typing import Any, Callable, Mapping, Sequence

from torch import fx, nn

from .. import epoch
from ..ops.base import Described
from .pattern import Pattern, PatternError, Predicate, _as_predicates
from .registry import Registry

__all__ = ["Rule", "RuleError", "MatchedOp", "Match", "Replacement", "RuleRegistry", "known_kinds", "caller_location",
           "check_predicate"]


class RuleError(PatternError):
    """A rule failed while a program was compiled: its builder or a predicate raised, its
    replacement computes something else than the ops it replaced, or it keeps matching its own
    output. The message names the rule and where it was defined."""


def check_predicate(rule: "Rule", pred: Predicate, subject, where: str = "") -> str | None:
    """``pred.check(subject)`` for ``rule``; an exception inside the predicate becomes a
    :class:`RuleError` naming the rule, its ``file:line`` and the predicate."""
    try:
        return pred.check(subject)
    except Exception as error:
        at = f" on {where}" if where else ""
        raise RuleError(f"rule {rule.name!r} ({rule.source}): predicate {pred.description!r}{at} raised "
                        f"{type(error).__name__}: {error}") from error


@dataclasses.dataclass
class MatchedOp:
    """One op of a match: its spec name, graph node, module and metadata."""

    name: str
    node: fx.Node
    op: Any
    meta: Any
    input_metas: tuple
    sharding: Any

    @property
    def kind(self) -> str:
        return self.op.kind


class Match:
    """A structural match of a rule's pattern variant in a graph (spec name -> :class:`MatchedOp`)."""

    def __init__(self, rule: "Rule", pattern: Pattern, ops: Mapping[str, MatchedOp]):
        self.rule = rule
        self.pattern = pattern
        self.ops = dict(ops)

    def __getitem__(self, name: str) -> MatchedOp:
        try:
            return self.ops[name]
        except KeyError:
            raise KeyError(
                f"rule {self.rule.name!r}: no op {name!r} in this match (matched: {sorted(self.ops)}); "
                f"use match.get(name) for optional ops"
            ) from None

    def get(self, name: str) -> MatchedOp | None:
        return self.ops.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self.ops

    def input(self, name: str, arg: int = 0) -> fx.Node:
        """The graph value feeding argument ``arg`` of matched op ``name``."""
        node = self[name].node
        if arg >= len(node.args):
            raise IndexError(f"rule {self.rule.name!r}: op {name!r} has {len(node.args)} args, asked for {arg}")
        return node.args[arg]

    def nodes(self) -> list[fx.Node]:
        return [m.node for m in self.ops.values()]

    def ordered(self) -> list[MatchedOp]:
        return [self.ops[n] for n in self.pattern.topological_names()]


@dataclasses.dataclass
class Replacement:
    """What a rule's builder returns.

    ``module`` replaces the matched ops and is called with ``args``: values of the matched graph
    (``match.input(name, arg)``, ``match[name].node``) or constants (``None``, ``bool``, ``int``,
    ``float``, tuples and lists of these); anything else (strings, tensors, modules) belongs in the
    module itself, and is refused with a :class:`RuleError` naming the rule.
    ``outputs`` maps each exported spec name to the index of its value in the module's output
    tuple; ``None`` means the module returns one tensor standing for the pattern's single output.
    """

    module: nn.Module
    args: Sequence[Any]
    outputs: Mapping[str, int] | None = None
    #: Name of the implementation the module will run, if it chooses one (shown in dumps).
    impl: str | None = None


def known_kinds() -> set[str]:
    """Kinds a pattern can name: the kind of every op class defined so far (basic ops: the class
    name; fused ops: their ``name``), plus fx's ``placeholder``/``output``/``getitem``."""
    kinds = {"placeholder", "output", "getitem"}
    stack = [Described]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            name = getattr(sub, "name", None)
            kinds.add(name if isinstance(name, str) and name else sub.__name__)
            stack.append(sub)
    return kinds


def caller_location(depth: int) -> str:
    """``file:line`` of the caller ``depth`` frames up (relative to the working directory when
    below it)."""
    frame = inspect.currentframe()
    try:
        for _ in range(depth + 1):
            frame = frame.f_back
        path = os.path.relpath(frame.f_code.co_filename) if frame else "?"
        if path.startswith(".."):
            path = frame.f_code.co_filename
        return f"{path}:{frame.f_lineno}" if frame else "?"
    finally:
        del frame


@dataclasses.dataclass
class Rule:
    """A fusion rule. ``source`` is filled with the ``file:line`` of the definition."""

    name: str
    pattern: Pattern
    build: Callable[[Match], Replacement]
    priority: int = 0
    where: Sequence[Any] = ()
    description: str = ""
    enabled: bool = True
    source: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or not self.name.replace("-", "_").isidentifier():
            raise PatternError(f"Rule: name={self.name!r}; expected a non-empty identifier-like string")
        if not isinstance(self.pattern, Pattern):
            raise PatternError(
                f"Rule {self.name!r}: pattern={self.pattern!r}; expected an opfuse.passes.Pattern "
                f"(e.g. Pattern.chain(OpSpec(...), ...))"
            )
        if not callable(self.build):
            raise PatternError(f"Rule {self.name!r}: build={self.build!r} is not callable")
        try:
            inspect.signature(self.build).bind(None)
        except TypeError:
            raise PatternError(
                f"Rule {self.name!r}: build must take one argument (the Match); got signature "
                f"{inspect.signature(self.build)}"
            ) from None
        except ValueError:  # builtins without signatures
            pass
        unknown = sorted({k for spec in self.pattern.specs for k in spec.kinds} - known_kinds())
        if unknown:
            hints = []
            for kind in unknown:
                close = difflib.get_close_matches(kind, sorted(known_kinds()), n=1)
                hints.append(f"{kind!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise PatternError(
                f"Rule {self.name!r}: unknown op kind(s) {', '.join(hints)}; kinds are op class names "
                f"(define custom ops before rules that match them)"
            )
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise PatternError(f"Rule {self.name!r}: priority={self.priority!r}; expected an int")
        self.where = _as_predicates(self.where, f"Rule {self.name!r}")
        if not self.source:
            self.source = caller_location(2)
        self._variants = self.pattern.variants()

    @property
    def variants(self) -> list[Pattern]:
        return self._variants

    def __setattr__(self, name, value):
        # Compiled programs depend on a rule's fields (``enabled``, ``priority``, ...).
        super().__setattr__(name, value)
        epoch.bump()

    def rule_predicates(self) -> tuple[Predicate, ...]:
        return tuple(self.where)

    def __repr__(self) -> str:
        return f"Rule({self.name!r}, {self.pattern.describe()}, priority={self.priority}, at {self.source})"


class RuleRegistry(Registry[Rule]):
    """The rules, highest priority first (ties: registration order); the one registry API
    (:class:`~.registry.Registry`) with ``register_rule`` / ``remove_rule`` / ``disabled_rules``
    messages and ``OPFUSE_DISABLE_RULES``."""

    kind = "rule"
    plural = "rules"
    setting = "disabled_rules"
    error = PatternError

    def _validate(self, rule: Rule) -> None:
        if not isinstance(rule, Rule):
            raise PatternError(f"register_rule: expected a Rule, got {type(rule).__name__}")

    def _duplicate(self, existing: Rule, rule: Rule) -> Exception:
        return PatternError(f"register_rule: a rule named {rule.name!r} exists (defined at {existing.source}); pass "
                            f"replace=True or remove_rule({rule.name!r})")

    def _unknown(self, what: str, names) -> Exception:
        known = sorted(self._entries)
        if isinstance(names, str):
            return KeyError(f"{what}: no rule named {names!r}; known: {known}")
        # A misspelt setting is a bad value (ValueError); a misspelt name in code, a lookup (KeyError).
        error = ValueError if what == self._setting_label() else KeyError
        return error(f"{what}: unknown rule(s) {list(names)}; known: {known}")

    def _order(self, rules: list[Rule]) -> list[Rule]:
        order = {name: i for i, name in enumerate(self._entries)}
        return sorted(rules, key=lambda r: (-r.priority, order[r.name]))

    def all(self) -> list[Rule]:
        """Every rule, highest priority first (ties: registration order)."""
        return self.ordered()

    def is_disabled(self, rule: Rule) -> str | None:
        """Why ``rule`` is off, or ``None`` if it is active."""
        if not rule.enabled:
            return "rule.enabled is False"
        return super().is_disabled(rule)

    def key(self) -> tuple:
        """Identifies the active rule set (compiled-program caches key on it)."""
        return tuple((r.name, id(r), r.priority) for r in self.active())
