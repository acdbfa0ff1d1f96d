"""Choosing an implementation for every fused op from the backend dispatch table."""

from __future__ import annotations

from torch import fx

from ..backend.fused.base import FusedOp

__all__ = ["select_implementations"]


def select_implementations(gm: fx.GraphModule, ctx) -> None:
    records = {r.fused_node: r for r in ctx.fusions}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        op = gm.get_submodule(node.target)
        if not isinstance(op, FusedOp):
            continue
        metas = [a.meta.get("opfuse_meta") if isinstance(a, fx.Node) else None for a in node.args]
        choice = op.select_implementation(metas)
        node.meta["opfuse_impl"] = choice.name
        record = records.get(node.name)
        if record is not None:
            record.impl = choice.name
            record.skipped = choice.skipped
