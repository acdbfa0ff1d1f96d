"""Fold (part of the cleanup pass): pairs of basic ops that no fusion rule took and that round twice
when run apart, merged into one op that rounds once (the float64 math, rounded once, is what every implementation aims
for; fused kernels accumulate in float32 too).

* ``BasicLinear -> Bias`` (the GEMM's value used by the bias only, not a partial sum): one
  ``BasicLinear`` with the bias inside the GEMM (``addmm``: the sum is rounded once).
* ``MakeExtraOutput -> RMSNorm/LayerNorm``: one :class:`~opfuse.ops.norm.ExtraOutputNorm`, whose
  backward adds the extra output's gradient to the norm's input gradient in float32 (autograd
  would add two rounded gradients).
"""

from __future__ import annotations

import operator

from torch import fx

from ...ops.extra import MakeExtraOutput
from ...ops.linear import BasicLinear, Bias
from ...ops.norm import ExtraOutputNorm, LayerNorm, RMSNorm
from ...machinery.rewrite import add_submodule

__all__ = ["fold"]


def _op(gm, node):
    return gm.get_submodule(node.target) if node.op == "call_module" else None


def _fold_bias(gm: fx.GraphModule, node: fx.Node, linear: BasicLinear) -> None:
    if linear.weight_sharding == "in" or linear.bias is not None or len(node.users) != 1:
        return
    (user,) = node.users
    bias = _op(gm, user)
    if not isinstance(bias, Bias) or user.args[0] is not node or len(user.args) != 1:
        return
    merged = BasicLinear(linear.in_features, linear.out_features, weight=linear.weight,
                         weight_sharding=linear.weight_sharding, recipe=linear.recipe, bias=bias.bias)
    name = add_submodule(gm, f"{node.target}_with_bias", merged)
    with gm.graph.inserting_after(user):
        new = gm.graph.call_module(name, node.args)
    new.meta.update(user.meta)
    user.replace_all_uses_with(new)
    gm.graph.erase_node(user)
    gm.graph.erase_node(node)


def _fold_norm(gm: fx.GraphModule, node: fx.Node) -> None:
    norms = [u for u in node.users if isinstance(_op(gm, u), (RMSNorm, LayerNorm)) and u.args[0] is node]
    if len(norms) != 1 or len(norms[0].args) != 1:
        return
    (norm_node,) = norms
    name = add_submodule(gm, f"{norm_node.target}_keeping_input", ExtraOutputNorm(_op(gm, norm_node)))
    graph = gm.graph
    with graph.inserting_after(norm_node):
        pair = graph.call_module(name, node.args)
    with graph.inserting_after(pair):
        y = graph.call_function(operator.getitem, (pair, 0))
    with graph.inserting_after(y):
        kept = graph.call_function(operator.getitem, (pair, 1))
    pair.meta.update(norm_node.meta)
    y.meta.update(norm_node.meta)
    kept.meta.update(node.meta)
    norm_node.replace_all_uses_with(y)
    graph.erase_node(norm_node)
    node.replace_all_uses_with(kept)
    graph.erase_node(node)


def fold(gm: fx.GraphModule, ctx) -> None:
    if not getattr(gm, "runs_modules", True):
        return  # a graph whose modules never run (torch.compile's op graphs: Inductor runs aten)
    for node in list(gm.graph.nodes):
        op = _op(gm, node)
        if isinstance(op, BasicLinear):
            _fold_bias(gm, node, op)
        elif isinstance(op, MakeExtraOutput):
            _fold_norm(gm, node)
    gm.delete_all_unused_submodules()
