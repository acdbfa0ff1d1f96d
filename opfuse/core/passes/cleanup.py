"""Cleanup, what is left after fusion: fold pairs of ops that no rule took and that would round
twice (:mod:`.fold`), then drop ops that compute nothing (``Identity``, a ``MakeExtraOutput`` left
unfused) and values nobody uses."""

from __future__ import annotations

from torch import fx

from ...ops.extra import Identity, MakeExtraOutput
from .fold import fold

__all__ = ["cleanup"]


def cleanup(gm: fx.GraphModule, ctx) -> None:
    fold(gm, ctx)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        op = gm.get_submodule(node.target)
        if isinstance(op, (Identity, MakeExtraOutput)):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
