"""Patterns: the data half of a fusion rule.

A :class:`Pattern` is a small graph of :class:`OpSpec` nodes (each accepting one or more op kinds,
optionally constrained by :class:`Predicate`\\s) connected by edges ``(producer, consumer, arg)``:
"``producer``'s value is argument ``arg`` of ``consumer``". :meth:`Pattern.chain` builds the
common case, a chain along the main input. Optional specs are expanded into concrete variants,
longest first, so ``AllReduce -> [Bias] -> RMSNorm`` tries the three-op form before the two-op one.

Examples
--------
>>> pattern = Pattern.chain(
...     OpSpec("ar", "AllReduce"),
...     OpSpec("bias", "Bias", optional=True),
...     OpSpec("norm", "RMSNorm", where=[weight_dtype_matches_input]),
... )                                                                  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Sequence

import networkx as nx

__all__ = ["Predicate", "predicate", "OpSpec", "Pattern", "PatternError"]


class PatternError(ValueError):
    """A rule or pattern is malformed."""


@dataclasses.dataclass(frozen=True)
class Predicate:
    """A named test on a matched op (in :class:`OpSpec`) or on a whole match (in a Rule).

    ``fn`` returns ``True`` to accept; ``False`` or a string (the reason, shown by
    ``Program.explain()``) to reject.
    """

    fn: Callable[[Any], Any]
    description: str

    def check(self, subject) -> str | None:
        """``None`` if accepted, else the reason for rejection."""
        result = self.fn(subject)
        if result is True:
            return None
        if result is False or result is None:
            return self.description
        if isinstance(result, str):
            return f"{self.description}: {result}"
        raise PatternError(
            f"predicate {self.description!r} returned {result!r}; expected True, False or a "
            f"reason string"
        )


def predicate(description: str) -> Callable[[Callable[[Any], Any]], Predicate]:
    """Decorator turning a function into a :class:`Predicate` with ``description``."""

    def wrap(fn: Callable[[Any], Any]) -> Predicate:
        return Predicate(fn, description)

    return wrap


def _as_predicates(items, owner: str) -> tuple[Predicate, ...]:
    if isinstance(items, Predicate) or callable(items):
        raise PatternError(f"{owner}: where={items!r} is one predicate; expected a sequence of them (where=[predicate])")
    if items is not None and not isinstance(items, (list, tuple)):
        raise PatternError(f"{owner}: where={items!r}; expected a list or tuple of predicates")
    result = []
    for item in items or ():
        if isinstance(item, Predicate):
            result.append(item)
        elif callable(item):
            result.append(Predicate(item, getattr(item, "__name__", repr(item))))
        else:
            raise PatternError(f"{owner}: where= entries must be Predicates or callables, got {item!r}")
    return tuple(result)


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One node of a pattern.

    Parameters
    ----------
    name:
        Label the replacement builder uses to look up the matched op (``match["norm"]``).
    kinds:
        Accepted op kinds (class names such as ``"RMSNorm"``); a string or a tuple.
    optional:
        The pattern also matches without this op (it must have at most one producer inside the
        pattern; its consumers are re-attached to that producer).
    where:
        Predicates on the matched op (:class:`opfuse.machinery.rule.MatchedOp`).
    exported:
        The op's value may have users outside the match; the replacement must provide it as an
        output. A spec with no consumer inside the pattern is always exported.
    """

    name: str
    kinds: tuple[str, ...] | str
    optional: bool = False
    where: tuple[Predicate, ...] | Sequence[Any] = ()
    exported: bool = False

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise PatternError(f"OpSpec: name={self.name!r}; expected an identifier")
        kinds = (self.kinds,) if isinstance(self.kinds, str) else \
            tuple(self.kinds) if isinstance(self.kinds, (list, tuple)) else ()
        if not kinds or not all(isinstance(k, str) and k for k in kinds):
            raise PatternError(
                f"OpSpec {self.name!r}: kinds={self.kinds!r}; expected op kind names such as "
                f"'RMSNorm' or a tuple of them"
            )
        object.__setattr__(self, "kinds", kinds)
        object.__setattr__(self, "where", _as_predicates(self.where, f"OpSpec {self.name!r}"))

    def describe(self) -> str:
        text = "|".join(self.kinds)
        return f"[{text}]" if self.optional else text


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A connected DAG of :class:`OpSpec`\\s; see the module docstring."""

    specs: tuple[OpSpec, ...]
    edges: tuple[tuple[str, str, int], ...]

    def __post_init__(self):
        specs = tuple(self.specs)
        edges = tuple((str(a), str(b), int(i)) for a, b, i in self.edges)
        object.__setattr__(self, "specs", specs)
        object.__setattr__(self, "edges", edges)
        if not specs:
            raise PatternError("Pattern: needs at least one OpSpec")
        names = [s.name for s in specs]
        duplicate = sorted({n for n in names if names.count(n) > 1})
        if duplicate:
            raise PatternError(f"Pattern: OpSpec names must be unique; repeated: {duplicate}")
        for src, dst, arg in edges:
            for end in (src, dst):
                if end not in names:
                    raise PatternError(f"Pattern: edge ({src!r} -> {dst!r}) names unknown spec {end!r}; known: {names}")
            if arg < 0:
                raise PatternError(f"Pattern: edge ({src!r} -> {dst!r}) has arg={arg}; expected >= 0")
        graph = self.to_networkx()
        if not nx.is_directed_acyclic_graph(graph):
            raise PatternError("Pattern: edges form a cycle")
        if len(specs) > 1 and not nx.is_weakly_connected(graph):
            raise PatternError("Pattern: specs must be connected by edges")
        for spec in specs:
            if spec.optional and graph.in_degree(spec.name) > 1:
                raise PatternError(
                    f"Pattern: optional spec {spec.name!r} has {graph.in_degree(spec.name)} producers; "
                    f"optional specs may have at most one"
                )
        if all(s.optional for s in specs):
            raise PatternError("Pattern: at least one OpSpec must be required")

    @classmethod
    def chain(cls, *specs: OpSpec) -> "Pattern":
        """Specs connected in order, each feeding the next one's main input (arg 0)."""
        for spec in specs:
            if not isinstance(spec, OpSpec):
                raise PatternError(f"Pattern.chain: expected OpSpec items, got {spec!r}")
        edges = tuple((a.name, b.name, 0) for a, b in zip(specs, specs[1:]))
        return cls(tuple(specs), edges)

    def spec(self, name: str) -> OpSpec:
        for spec in self.specs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def to_networkx(self) -> nx.DiGraph:
        graph = nx.DiGraph()
        for spec in self.specs:
            graph.add_node(spec.name, spec=spec)
        for src, dst, arg in self.edges:
            if graph.has_edge(src, dst):
                graph[src][dst]["args"] = graph[src][dst]["args"] | {arg}
            else:
                graph.add_edge(src, dst, args=frozenset({arg}))
        return graph

    def topological_names(self) -> list[str]:
        order = {s.name: i for i, s in enumerate(self.specs)}
        return list(nx.lexicographical_topological_sort(self.to_networkx(), key=order.__getitem__))

    def outputs(self) -> list[str]:
        """Specs whose values leave the match: sinks and ``exported`` specs, in spec order."""
        graph = self.to_networkx()
        return [s.name for s in self.specs if s.exported or graph.out_degree(s.name) == 0]

    def without(self, name: str) -> "Pattern":
        """This pattern with optional spec ``name`` removed and its consumers re-attached."""
        producers = [(src, arg) for src, dst, arg in self.edges if dst == name and arg == 0]
        producers += [(src, arg) for src, dst, arg in self.edges if dst == name and arg != 0]
        edges = []
        for src, dst, arg in self.edges:
            if dst == name:
                continue
            if src == name:
                if not producers:
                    continue
                edges.append((producers[0][0], dst, arg))
            else:
                edges.append((src, dst, arg))
        # An exported optional spec that is absent exports nothing: its producer stays interior.
        specs = tuple(s for s in self.specs if s.name != name)
        return Pattern(specs, tuple(dict.fromkeys(edges)))

    def variants(self) -> list["Pattern"]:
        """Concrete patterns (no optional specs left), most specs first."""
        optional = [s.name for s in self.specs if s.optional]
        result = []
        for count in range(len(optional) + 1):
            for dropped in itertools.combinations(optional, count):
                pattern = self
                for name in dropped:
                    pattern = pattern.without(name)
                pattern = Pattern(
                    tuple(dataclasses.replace(s, optional=False) for s in pattern.specs), pattern.edges
                )
                result.append(pattern)
        return result

    def describe(self) -> str:
        if len(self.edges) == len(self.specs) - 1 and all(a == 0 for _, _, a in self.edges):
            order = self.topological_names()
            if all((a, b, 0) in self.edges for a, b in zip(order, order[1:])):
                return " -> ".join(self.spec(n).describe() for n in order)
        body = ", ".join(f"{a}->{b}[{i}]" for a, b, i in self.edges)
        return f"{{{', '.join(s.describe() for s in self.specs)}; {body}}}"
