"""Compiled graphs call opfuse's fused ops through their ``direct`` overloads.

A fused op is a ``torch.library.custom_op`` with an autograd formula, which is what Dynamo and
AOTAutograd need to trace it (``opfuse::<name>.default``). Once the graph pass has run, the
graph is past autograd: a training graph already holds the backward, an inference graph has none.
Each call through the custom op's wrappers (autograd, redispatch, backend wrapper and its alias
check) then only costs host time, so the pass points the calls at ``opfuse::<name>.direct``
(same schema, fake and function, registered straight on the dispatcher:
:data:`opfuse.machinery.fused_op.DIRECT_OVERLOADS`), last, after every pass that reads the graph.
"""

from __future__ import annotations

from torch import fx

from ..machinery.fused_op import DIRECT_OVERLOADS

__all__ = ["use_direct_overloads"]


def use_direct_overloads(graph: fx.Graph) -> int:
    """Point every call of a fused op's custom op in ``graph`` at its ``direct`` overload; returns
    how many calls changed."""
    changed = 0
    for node in graph.nodes:
        if node.op == "call_function":
            direct = DIRECT_OVERLOADS.get(node.target)
            if direct is not None:
                node.target = direct
                changed += 1
    return changed
