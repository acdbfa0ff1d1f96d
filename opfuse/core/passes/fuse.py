"""The fusion pass: apply the active rules, highest priority first, until none matches."""

from __future__ import annotations

from torch import fx

from ...config import config
from ...machinery.context import FusionRecord
from ...machinery.matcher import check_legal, find_matches, graph_to_networkx, node_kind
from ..rules import get_registry
from ...machinery.rewrite import replace_match, snake_case
from ...machinery.rule import Match, Replacement, Rule, RuleError

__all__ = ["FusionRecord", "fuse"]


def _still_legal(gm: fx.GraphModule, match) -> bool:
    """``match`` (found before this round's rewrites) is still legal in the edited graph."""
    if any(getattr(node, "_erased", False) for node in match.nodes()):
        return False
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    mapping = {name: matched.node for name, matched in match.ops.items()}
    return check_legal(None, match.pattern, mapping, order=order.__getitem__, kind=lambda n: node_kind(gm, n)) is None


def _build(rule: Rule, match: Match) -> Replacement:
    try:
        return rule.build(match)
    except Exception as error:
        covered = ", ".join(f"{m.node.name} ({m.kind})" for m in match.ordered())
        raise RuleError(f"rule {rule.name!r} ({rule.source}): its builder raised {type(error).__name__}: {error} "
                        f"(building the replacement of {covered})") from error


def fuse(gm: fx.GraphModule, ctx) -> None:
    """Rounds: the highest-priority rule that matches anywhere fuses all its non-overlapping
    matches, in graph order (each checked again against the graph its predecessors edited), then
    the next round starts from the highest-priority rule again; until no rule matches.

    Termination: a rewrite replaces the matched nodes by one. One that replaces several nodes, or
    a node that no rewrite produced, makes progress; one that replaces a single node produced by
    earlier rewrites is legal once per rule along that node's history (``GELU -> MyGelu ->
    MyGeluFast``), and a rule that reappears in the history of the node it matches would rewrite
    forever: that is an error naming the rules, raised at once.
    """
    if not config.fuse:
        return
    rules = get_registry().active()
    history: dict[fx.Node, tuple[str, ...]] = {}  # fused node -> rules that produced it, in order
    # The argument above bounds the rewrites by (nodes + 1) * (rules + 1); the limit is a backstop.
    limit = (len(gm.graph.nodes) + 1) * (len(rules) + 1)
    for _ in range(limit):
        graph = graph_to_networkx(gm)
        applied = 0
        for rule in rules:
            taken: set = set()
            for match in list(find_matches(gm, rule, graph)):  # found before any rewrite of this round
                nodes = set(match.nodes())
                if nodes & taken or (applied and not _still_legal(gm, match)):
                    continue
                taken |= nodes
                covered = match.ordered()
                before = tuple(dict.fromkeys(r for m in covered for r in history.get(m.node, ())))
                if len(covered) == 1 and rule.name in before:
                    chain = " -> ".join(before + (rule.name,))
                    raise RuleError(
                        f"rule {rule.name!r} ({rule.source}) matches {covered[0].node.name} ({covered[0].kind}), which "
                        f"came out of rule {rule.name!r} itself (rules applied to it: {chain}): fusion would rewrite "
                        f"it forever; let the pattern or a predicate reject the replacement's op")
                replacement = _build(rule, match)
                node = replace_match(gm, match, replacement, f"fused_{snake_case(rule.name)}")
                history[node] = before + (rule.name,)
                ctx.fusions.append(FusionRecord(
                    rule=rule.name,
                    ops=tuple(m.kind for m in covered),
                    nodes=tuple(m.node.name for m in covered),
                    impl=replacement.impl,
                    source=rule.source,
                    fused_node=node.name,
                ))
                applied += 1
            if applied:
                break
        if not applied:
            return
    raise RuleError(f"fusion did not reach a fixed point after {limit} rounds; the last rules applied: "
                    f"{[r.rule for r in ctx.fusions[-5:]]}")
