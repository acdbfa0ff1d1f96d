"""Finding rule matches in an fx graph with networkx subgraph matching, checking that fusing a
match is legal, and explaining near misses.

The fx graph becomes an ``nx.DiGraph`` whose nodes carry the op kind and whose edges carry the
argument positions (``producer -> consumer``, ``args={0}``). A pattern variant matches where
VF2 finds a monomorphism that respects kinds and argument positions; structure, not textual
order, decides. A structural match is then *legal* when

* no interior value (a matched op that the pattern does not export) is used outside the match,
* no matched op reads another matched op's value through an argument the pattern does not name,
* replacing the match by one node creates no cycle.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Iterator

import networkx as nx
from networkx.algorithms import isomorphism
from torch import fx

from .pattern import Pattern
from .rule import Match, MatchedOp, Rule, check_predicate

__all__ = ["node_kind", "graph_to_networkx", "find_matches", "check_legal", "NearMiss", "near_misses",
           "evaluate_match"]


def node_op(gm: fx.GraphModule, node: fx.Node):
    if node.op == "call_module":
        return gm.get_submodule(node.target)
    return None


def node_kind(gm: fx.GraphModule, node: fx.Node) -> str:
    """The kind a pattern matches on: the op's kind for ops, else the fx opcode."""
    op = node_op(gm, node)
    if op is not None:
        return getattr(op, "kind", type(op).__name__)
    if node.op == "call_function" and node.target is operator.getitem:
        return "getitem"
    return node.op


def _flat_args(node: fx.Node) -> list:
    return list(node.args) + list(node.kwargs.values())


def graph_to_networkx(gm: fx.GraphModule) -> nx.DiGraph:
    graph = nx.DiGraph()
    by_kind: dict[str, list[fx.Node]] = {}
    for index, node in enumerate(gm.graph.nodes):
        kind = node_kind(gm, node)
        graph.add_node(node, kind=kind, order=index)
        by_kind.setdefault(kind, []).append(node)
    graph.graph["by_kind"] = by_kind
    for node in gm.graph.nodes:
        for position, arg in enumerate(_flat_args(node)):
            for source in _nodes_in(arg):
                if graph.has_edge(source, node):
                    graph[source][node]["args"] = graph[source][node]["args"] | {position}
                else:
                    graph.add_edge(source, node, args=frozenset({position}))
    return graph


def _nodes_in(arg) -> list[fx.Node]:
    if isinstance(arg, fx.Node):
        return [arg]
    if isinstance(arg, (tuple, list)):
        return [n for item in arg for n in _nodes_in(item)]
    return []


def _pattern_graph(pattern: Pattern, names: list[str] | None = None) -> nx.DiGraph:
    graph = pattern.to_networkx()
    return graph.subgraph(names).copy() if names is not None else graph


def _of_kinds(graph: nx.DiGraph, kinds) -> list:
    by_kind = graph.graph.get("by_kind")
    if by_kind is None:
        return [n for n, kind in graph.nodes(data="kind") if kind in kinds]
    return [n for kind in kinds for n in by_kind.get(kind, ())]


def _candidates(graph: nx.DiGraph, pattern_graph: nx.DiGraph) -> nx.DiGraph:
    """The part of ``graph`` a match can use: nodes of the pattern's kinds within the pattern's
    reach of a node of its rarest kind, and the edges between them. Every match lies there (it
    holds such a node, and the pattern is connected), so matching there finds the same
    monomorphisms as in the whole graph; in the op graph of a compiled model, mostly aten nodes
    no pattern names, it is a small part."""
    specs = [data["spec"] for _, data in pattern_graph.nodes(data=True)]
    kinds = {kind for spec in specs for kind in spec.kinds}
    eligible = set(_of_kinds(graph, kinds))
    anchors = min((_of_kinds(graph, spec.kinds) for spec in specs), key=len)
    reach = len(specs) - 1
    found = set(anchors)
    frontier = list(anchors)
    for _ in range(reach):
        step = []
        for node in frontier:
            for near in itertools.chain(graph.successors(node), graph.predecessors(node)):
                if near in eligible and near not in found:
                    found.add(near)
                    step.append(near)
        frontier = step
    return graph.subgraph(found).copy()


def _structural(graph: nx.DiGraph, pattern_graph: nx.DiGraph) -> Iterator[dict[str, fx.Node]]:
    target = _candidates(graph, pattern_graph)
    if target.number_of_nodes() < pattern_graph.number_of_nodes():
        return
    matcher = isomorphism.DiGraphMatcher(
        target,
        pattern_graph,
        node_match=lambda g, p: g["kind"] in p["spec"].kinds,
        edge_match=lambda g, p: p["args"] <= g["args"],
    )
    seen = set()
    found = []
    for mapping in matcher.subgraph_monomorphisms_iter():
        inverse = {p: g for g, p in mapping.items()}
        key = frozenset(inverse.items())
        if key not in seen:
            seen.add(key)
            found.append(inverse)
    # Deterministic: by the graph position of the matched nodes.
    found.sort(key=lambda m: sorted(graph.nodes[n]["order"] for n in m.values()))
    yield from found


def make_match(gm: fx.GraphModule, rule: Rule, pattern: Pattern, mapping: dict[str, fx.Node]) -> Match:
    ops = {}
    for name, node in mapping.items():
        inputs = tuple(a.meta.get("opfuse_meta") if isinstance(a, fx.Node) else None for a in node.args)
        ops[name] = MatchedOp(name=name, node=node, op=node_op(gm, node), meta=node.meta.get("opfuse_meta"),
                              input_metas=inputs, sharding=node.meta.get("opfuse_sharding"))
    return Match(rule, pattern, ops)


def check_legal(graph: nx.DiGraph, pattern: Pattern, mapping: dict[str, fx.Node], order=None, kind=None) -> str | None:
    """``None`` if replacing the match by one node is legal, else why not. ``order`` (node ->
    position in a topological order) and ``kind`` (node -> kind) default to ``graph``'s; passing
    them checks a match against an fx graph edited since ``graph`` was built."""
    order = order or (lambda n: graph.nodes[n]["order"])
    kind = kind or (lambda n: graph.nodes[n]["kind"])
    inside = set(mapping.values())
    exported = set(pattern.outputs())
    for name, node in mapping.items():
        if name in exported:
            continue
        outside = [user for user in node.users if user not in inside]
        if outside:
            users = ", ".join(f"{u.name} ({kind(u)})" for u in outside)
            return f"interior value {node.name} ({kind(node)}) is also used by {users}"
    wanted = {(mapping[a], mapping[b], arg) for a, b, arg in pattern.edges}
    for node in mapping.values():
        for position, arg in enumerate(_flat_args(node)):
            for source in _nodes_in(arg):
                if source in inside and (source, node, position) not in wanted:
                    return (f"{node.name} reads matched value {source.name} through argument {position}, "
                            f"which the pattern does not connect")
    if _leaves_and_returns(inside, order):
        return "fusing would create a cycle (a value leaves the match and comes back into it)"
    return None


def _leaves_and_returns(inside: set, order) -> bool:
    """A path from a matched node through unmatched ones back to a matched node (replacing the
    match by one node would close it into a cycle). ``order`` is topological, so the search
    stops at nodes after the last matched one."""
    last = max(order(n) for n in inside)
    stack = [user for node in inside for user in node.users if user not in inside]
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen or order(node) > last:
            continue
        seen.add(node)
        for user in node.users:
            if user in inside:
                return True
            stack.append(user)
    return False


def evaluate_match(match: Match) -> str | None:
    """Run op-level then rule-level predicates; ``None`` if all accept, else the first reason."""
    for name in match.pattern.topological_names():
        matched = match.ops[name]
        for pred in match.pattern.spec(name).where:
            reason = check_predicate(match.rule, pred, matched, f"{name} ({matched.node.name})")
            if reason:
                return f"{name} ({matched.node.name}): {reason}"
    for pred in match.rule.rule_predicates():
        reason = check_predicate(match.rule, pred, match, "the match")
        if reason:
            return reason
    return None


def find_matches(gm: fx.GraphModule, rule: Rule, graph: nx.DiGraph | None = None) -> Iterator[Match]:
    """Legal matches of ``rule`` in ``gm`` whose predicates all accept, variant by variant
    (most ops first), in graph order."""
    graph = graph if graph is not None else graph_to_networkx(gm)
    present = {kind for _, kind in graph.nodes(data="kind")}
    for variant in rule.variants:
        if not all(present.intersection(spec.kinds) for spec in variant.specs):
            continue  # a kind the variant needs is absent: no subgraph search
        for mapping in _structural(graph, _pattern_graph(variant)):
            if check_legal(graph, variant, mapping) is not None:
                continue
            match = make_match(gm, rule, variant, mapping)
            if evaluate_match(match) is None:
                yield match


# Near misses -------------------------------------------------------------------------------


@dataclasses.dataclass
class NearMiss:
    """How far a rule matched at one place in a graph, and what stopped it."""

    rule: str
    source: str
    variant: str
    matched: list[str]
    total: int
    reason: str
    #: For a prefix that stopped because no neighbour had a fitting kind: ``(kinds, where, found)``
    #: (variants that stop at the same place merge their kinds into one reason).
    expected: tuple | None = None

    def describe(self) -> str:
        chain = " -> ".join(self.matched) if self.matched else "(nothing)"
        return (f"{self.rule} [{self.source}]: matched {len(self.matched)}/{self.total} of "
                f"{self.variant}: {chain}; {self.reason}")


def _expected_reason(kinds, where: str, found: str) -> str:
    return f"expected {'|'.join(kinds)} next to {where}, found {found}"


def _prefix_failure(gm, graph, rule, variant, order, mapping) -> tuple[str, tuple | None]:
    """Why spec ``order[len(mapping)]`` could not extend ``mapping``, and ``(kinds, where, found)``
    when no neighbour had one of the spec's kinds."""
    nxt = variant.spec(order[len(mapping)])
    feeding = [(a, i) for a, b, i in variant.edges if b == nxt.name and a in mapping]
    consuming = [(b, i) for a, b, i in variant.edges if a == nxt.name and b in mapping]
    candidates = set()
    for producer, arg in feeding:
        node = mapping[producer]
        for user in node.users:
            if user in mapping.values():
                continue
            positions = graph.edges[node, user]["args"] if graph.has_edge(node, user) else frozenset()
            if arg in positions:
                candidates.add(user)
    for consumer, arg in consuming:
        args = _flat_args(mapping[consumer])
        if arg < len(args):
            candidates.update(n for n in _nodes_in(args[arg]) if n not in mapping.values())
    where = ", ".join(f"{mapping[p].name}" for p, _ in feeding) or ", ".join(mapping[c].name for c, _ in consuming)
    fitting = [c for c in candidates if graph.nodes[c]["kind"] in nxt.kinds]
    if not fitting:
        found = ", ".join(sorted(f"{c.name} ({graph.nodes[c]['kind']})" for c in candidates)) or "nothing"
        return _expected_reason(nxt.kinds, where, found), (tuple(nxt.kinds), where, found)
    reasons = []
    for cand in sorted(fitting, key=lambda n: graph.nodes[n]["order"]):
        trial = make_match(gm, rule, variant, {**mapping, nxt.name: cand})
        for pred in nxt.where:
            reason = check_predicate(rule, pred, trial.ops[nxt.name], f"{nxt.name} ({cand.name})")
            if reason:
                reasons.append(f"{nxt.name} ({cand.name}): predicate failed: {reason}")
                break
    return "; ".join(reasons) or f"{nxt.name}: no legal candidate", None


def _matched(graph, order, mapping) -> list[str]:
    return [f"{mapping[n].name} ({graph.nodes[mapping[n]]['kind']})" for n in order[:len(mapping)]]


def _merge_expected(miss: NearMiss, gm, graph, rule, variant, order, mapping) -> None:
    """Another variant stopped after the same ops: list its expected kinds too
    ("expected Bias|AddExtraInput|RMSNorm next to ...")."""
    if miss.expected is None or len(mapping) == len(order) or _matched(graph, order, mapping) != miss.matched:
        return
    _, expected = _prefix_failure(gm, graph, rule, variant, order, mapping)
    if expected is None or expected[1:] != miss.expected[1:]:
        return
    kinds = tuple(dict.fromkeys(miss.expected[0] + expected[0]))
    miss.expected = (kinds, *expected[1:])
    miss.reason = _expected_reason(*miss.expected)


def near_misses(gm: fx.GraphModule, rule: Rule, disabled_reason: str | None = None) -> list[NearMiss]:
    """Places where ``rule`` matched partly (or fully but illegally) in ``gm``: the longest prefix
    per anchor over all variants."""
    graph = graph_to_networkx(gm)
    best: dict[fx.Node, NearMiss] = {}
    for variant in rule.variants:
        order = variant.topological_names()
        for size in range(len(order), 0, -1):
            prefix_graph = _pattern_graph(variant, order[:size])
            if size > 1 and not nx.is_weakly_connected(prefix_graph):
                continue
            for mapping in _structural(graph, prefix_graph):
                anchor = mapping[order[0]]
                if anchor in best and len(best[anchor].matched) > size:
                    continue
                if anchor in best and len(best[anchor].matched) == size:
                    if size < len(order) or len(best[anchor].matched) == best[anchor].total:
                        _merge_expected(best[anchor], gm, graph, rule, variant, order, mapping)
                        continue
                    # else: this shorter variant matched completely where a longer one stopped;
                    # why the complete match did not fire says more.
                trial = make_match(gm, rule, variant, mapping)
                failed = None
                for name in order[:size]:
                    for pred in variant.spec(name).where:
                        if check_predicate(rule, pred, trial.ops[name], f"{name} ({mapping[name].name})"):
                            failed = name
                            break
                    if failed:
                        break
                if failed:
                    continue
                if size == len(order):
                    reason = disabled_reason or check_legal(graph, variant, mapping) or evaluate_match(trial)
                    if reason is None:
                        reason = "matches: the rule can fire here (it was shadowed or ran out of iterations)"
                    expected = None
                else:
                    reason, expected = _prefix_failure(gm, graph, rule, variant, order, mapping)
                matched = _matched(graph, order, mapping)
                best[anchor] = NearMiss(rule.name, rule.source, variant.describe(), matched, len(order), reason,
                                        expected)
    return sorted(best.values(), key=lambda m: (-len(m.matched), m.matched))
