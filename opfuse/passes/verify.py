"""Verify: the final graph is well formed and executable."""

from __future__ import annotations

from torch import fx

from ..backend.registry import FusedOp
from ..config import config

__all__ = ["verify", "VerifyError"]


class VerifyError(RuntimeError):
    """A pass produced a malformed graph (a bug in a rule or pass)."""


def verify(gm: fx.GraphModule, ctx) -> None:
    if not config.verify:
        return
    try:
        gm.graph.lint()
    except Exception as error:  # fx raises RuntimeError with details
        raise VerifyError(f"graph lint failed after the pipeline: {error}") from error
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        op = gm.get_submodule(node.target)
        if getattr(op, "is_composite", False):
            raise VerifyError(f"{node.name}: composite op {op.kind} was not expanded by the partition pass")
        if isinstance(op, FusedOp) and op.implementation is None:
            raise VerifyError(f"{node.name}: fused op {op.kind} has no implementation selected")
        if "opfuse_meta" not in node.meta:
            raise VerifyError(f"{node.name}: no tensor metadata (a rule dropped node.meta)")
