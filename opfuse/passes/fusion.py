"""The fusion pass: apply the active rules, highest priority first, until none matches."""

from __future__ import annotations

from torch import fx

from ..config import config
from .context import FusionRecord
from .matcher import check_legal, find_matches, graph_to_networkx, node_kind
from .rewrite import replace_match, snake_case
from .registry import get_registry

__all__ = ["FusionRecord", "fuse"]

_MAX_ROUNDS = 10_000


def _still_legal(gm: fx.GraphModule, match) -> bool:
    """``match`` (found before this round's rewrites) is still legal in the edited graph."""
    if any(getattr(node, "_erased", False) for node in match.nodes()):
        return False
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    mapping = {name: matched.node for name, matched in match.ops.items()}
    return check_legal(None, match.pattern, mapping, order=order.__getitem__, kind=lambda n: node_kind(gm, n)) is None


def fuse(gm: fx.GraphModule, ctx) -> None:
    """Rounds: the highest-priority rule that matches anywhere fuses all its non-overlapping
    matches, in graph order (each checked again against the graph its predecessors edited), then
    the next round starts from the highest-priority rule again; until no rule matches."""
    if not config.fuse:
        return
    rules = get_registry().active()
    for _ in range(_MAX_ROUNDS):
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
                replacement = rule.build(match)
                node = replace_match(gm, match, replacement, f"fused_{snake_case(rule.name)}")
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
    raise RuntimeError(f"fusion did not reach a fixed point after {_MAX_ROUNDS} rounds (a rule keeps matching "
                       f"its own output?)")
