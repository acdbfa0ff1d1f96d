"""The fusion pass: apply the active rules, highest priority first, until none matches."""

from __future__ import annotations

from torch import fx

from ..config import config
from .context import FusionRecord
from .matcher import find_matches, graph_to_networkx
from .rewrite import replace_match, snake_case
from .registry import get_registry

__all__ = ["FusionRecord", "fuse"]

_MAX_REWRITES = 10_000


def fuse(gm: fx.GraphModule, ctx) -> None:
    if not config.fuse:
        return
    rules = get_registry().active()
    for _ in range(_MAX_REWRITES):
        graph = graph_to_networkx(gm)
        applied = False
        for rule in rules:
            match = next(find_matches(gm, rule, graph), None)
            if match is None:
                continue
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
            applied = True
            break
        if not applied:
            return
    raise RuntimeError(f"fusion did not reach a fixed point after {_MAX_REWRITES} rewrites (a rule keeps matching "
                       f"its own output?)")
