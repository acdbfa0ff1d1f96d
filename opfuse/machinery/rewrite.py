"""Replacing a matched subgraph by one fused node (plus ``getitem`` nodes for its outputs)."""

from __future__ import annotations

import operator
import re

from torch import fx

from .pattern import PatternError
from .rule import Match, Replacement, RuleError

__all__ = ["replace_match", "snake_case", "add_submodule", "reorder_topologically"]


def snake_case(name: str) -> str:
    text = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name)
    text = re.sub(r"(?<=[A-Z])([A-Z][a-z])", r"_\1", text)
    return re.sub(r"[^0-9a-zA-Z_]", "_", text).lower()


def add_submodule(gm: fx.GraphModule, base: str, module) -> str:
    """Register ``module`` on ``gm`` under a fresh name derived from ``base``; return the name."""
    name, counter = base, 1
    while hasattr(gm, name):
        counter += 1
        name = f"{base}_{counter}"
    gm.add_submodule(name, module)
    return name


def reorder_topologically(graph: fx.Graph, after: fx.Node | None = None, through: fx.Node | None = None) -> None:
    """Reorder nodes so that every node follows its inputs, keeping the original order
    where it already does (placeholders stay first, the output stays last).

    With ``after`` and ``through``, only the nodes after ``after`` up to ``through`` move: a
    rewrite that inserted its nodes up to ``through`` passes the node before the first one it
    replaced, so the rest of the graph (in order before the rewrite) is not walked. The result is
    the same as reordering the whole graph, at the cost of the span."""
    if after is None:
        nodes = list(graph.nodes)
    else:
        nodes, node = [], after.next
        while True:
            nodes.append(node)
            if node is through:
                break
            node = node.next
            if node.op == "root":
                raise ValueError(f"reorder_topologically: {through} does not follow {after}")
    order = {node: i for i, node in enumerate(nodes)}
    # Inputs outside the span come before it (the graph was in order outside what the rewrite
    # touched). Most rewrites leave the span in order too: one linear check.
    if all(order.get(dep, -1) < i for node, i in order.items() for dep in node.all_input_nodes):
        return
    placed: set[fx.Node] = set()
    result: list[fx.Node] = []

    def visit(node: fx.Node) -> None:
        if node in placed or node not in order:
            return
        for dep in sorted((d for d in node.all_input_nodes if d in order), key=order.__getitem__):
            visit(dep)
        placed.add(node)
        result.append(node)

    for node in nodes:
        visit(node)
    anchor = after
    for node in result:
        if anchor is None:
            anchor = node
            continue
        anchor.append(node)
        anchor = node


#: Constants a replacement module may take as arguments besides graph values (what a program's
#: generated code writes as literals).
_CONSTANTS = (type(None), bool, int, float)


def _check_arg(gm: fx.GraphModule, match: Match, position: int, arg) -> None:
    """Raise :class:`RuleError` naming the rule and where it was defined unless ``arg`` is a value
    of this graph or a constant (a tuple or list of them included). A wrong argument would only
    fail when the program runs, inside the replacement module, without naming the rule."""
    if isinstance(arg, (tuple, list)):
        for item in arg:
            _check_arg(gm, match, position, item)
        return
    if isinstance(arg, fx.Node) and arg.graph is gm.graph:
        return
    if isinstance(arg, _CONSTANTS):
        return
    what = "a node of another graph" if isinstance(arg, fx.Node) else f"a {type(arg).__name__}"
    hint = " (a node's name is not its value)" if isinstance(arg, str) else ""
    raise RuleError(
        f"rule {match.rule.name!r} ({match.rule.source}): Replacement.args[{position}] is {arg!r}, {what}{hint}; "
        f"accepted: values of the matched graph (match.input(name, arg), match[name].node) and constants (None, "
        f"bool, int, float); put anything else (strings, tensors, modules) in the replacement module")


def replace_match(gm: fx.GraphModule, match: Match, replacement: Replacement, module_base: str) -> fx.Node:
    """Insert ``replacement`` for ``match``; returns the fused node. Each new value records the
    name of the matched value it replaces (``node.meta["opfuse_replaces"]``)."""
    if not isinstance(replacement, Replacement):
        raise PatternError(
            f"rule {match.rule.name!r} ({match.rule.source}): build returned {type(replacement).__name__}; "
            f"expected an opfuse.passes.Replacement"
        )
    exported = match.pattern.outputs()
    outputs = replacement.outputs
    if outputs is None:
        if len(exported) != 1:
            raise PatternError(
                f"rule {match.rule.name!r} ({match.rule.source}): the pattern exports {exported}; the "
                f"Replacement must map each to an output index (outputs={{name: index}})"
            )
        outputs = {exported[0]: None}
    missing = [name for name in exported if name not in outputs and match[name].node.users]
    if missing:
        raise PatternError(
            f"rule {match.rule.name!r} ({match.rule.source}): Replacement.outputs lacks exported op(s) "
            f"{missing}; it maps {sorted(outputs)}"
        )
    inside = set(match.nodes())
    for position, arg in enumerate(replacement.args):
        _check_arg(gm, match, position, arg)
        if isinstance(arg, fx.Node) and arg in inside:
            raise PatternError(
                f"rule {match.rule.name!r} ({match.rule.source}): Replacement.args uses {arg.name}, a value "
                f"computed inside the match; pass the match's inputs (match.input(name, arg))"
            )

    graph = gm.graph
    ordered = [n for n in graph.nodes if n in inside]
    before = ordered[0].prev  # the rewrite touches the graph from here on
    target = add_submodule(gm, module_base, replacement.module)
    with graph.inserting_after(ordered[-1]):
        fused = graph.call_module(target, tuple(replacement.args))
    fused.meta["opfuse_rule"] = match.rule.name
    fused.meta["opfuse_source"] = match.rule.source
    fused.meta["opfuse_covered"] = [(m.node.name, m.kind) for m in match.ordered()]
    last_meta = match.ordered()[-1].node.meta
    fused.meta["opfuse_sharding"] = last_meta.get("opfuse_sharding")

    cursor = fused
    for name, index in outputs.items():
        old = match[name].node
        if index is None:
            value = fused
            fused.meta["opfuse_meta"] = old.meta.get("opfuse_meta")
            fused.meta["opfuse_replaces"] = old.name
        else:
            with graph.inserting_after(cursor):
                value = graph.call_function(operator.getitem, (fused, index))
            cursor = value
            value.meta["opfuse_meta"] = old.meta.get("opfuse_meta")
            value.meta["opfuse_sharding"] = old.meta.get("opfuse_sharding")
            value.meta["opfuse_replaces"] = old.name
        old.replace_all_uses_with(value, delete_user_cb=lambda user: user not in inside)
    if all(index is not None for index in outputs.values()):
        fused.meta["opfuse_meta"] = tuple(match[n].node.meta.get("opfuse_meta") for n in outputs)
    for node in reversed(ordered):
        graph.erase_node(node)
    reorder_topologically(graph, before, cursor)
    return fused
