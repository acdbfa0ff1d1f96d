"""Recognising grouped GEMMs in aten graphs (the torch.compile front end).

``opfuse::grouped_linear(x, group_sizes, weight, None, "", impl)`` (what a rewritten mixture-of-experts
block calls, :mod:`opfuse.torch_compile.moe`) is a ``BasicGroupedLinear``: the pipeline then chooses
its implementation for the graph's shapes (and, with an FP8 recipe, makes it ``grouped_linear_fp8``).
Its weight must be a graph input or a view of graph inputs (the stacked experts), so that the op
graph can show it as the op's parameter. The backward the joint graph already holds
(``opfuse::grouped_linear_backward`` on the same ``x``, ``group_sizes`` and ``weight``) is found by
:func:`grouped_backward` for the lowering, which points it at the chosen implementation.

A recognizer for ``torch._grouped_mm`` (torchtitan's MoE) lives beside this one in the structure
redesign; this module recognises only opfuse's own grouped op.
"""

from __future__ import annotations

import torch
from torch import fx

from ...machinery.aten import aten, calls, dtype, is_tensor_node, shape
from ...machinery.region import ParamSource, Region, frozen, standin
from ...ops.grouped import BasicGroupedLinear

__all__ = ["grouped_linear", "grouped_backward", "weight_source"]

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.as_strided.default,
          aten.alias.default)


def _op(name: str):
    return getattr(torch.ops.opfuse, name).default


def weight_source(node) -> fx.Node | None:
    """The graph input ``node`` is a view of (``node`` itself when it is an input), else ``None``."""
    while calls(node, *_VIEWS):
        node = node.args[0]
    return node if isinstance(node, fx.Node) and node.op == "placeholder" else None


def grouped_linear(node: fx.Node) -> Region | None:
    if not calls(node, _op("grouped_linear")):
        return None
    x, sizes, weight, bias, fsdp_group = node.args[:5]
    if bias is not None or fsdp_group or not all(is_tensor_node(n) for n in (x, sizes, weight)):
        return None
    if weight_source(weight) is None or len(shape(weight)) != 3 or len(shape(x)) != 2:
        return None
    groups, n, k = shape(weight)
    if shape(x)[1] != k or dtype(x) != dtype(weight):
        return None
    weight_standin = standin((groups, n, k), dtype(weight))
    op = frozen(BasicGroupedLinear(groups, k, n, weight=weight_standin))
    return Region(op, (x, sizes), node, frozenset({node}), {weight_standin: ParamSource(weight)})


def grouped_backward(forward: fx.Node) -> fx.Node | None:
    """The ``grouped_linear_backward`` call of the joint graph that differentiates ``forward``
    (same ``x``, ``group_sizes`` and ``weight``), if any."""
    x, sizes, weight = forward.args[:3]
    found = [u for u in x.users if calls(u, _op("grouped_linear_backward"))
             and u.args[1] is x and u.args[2] is sizes and u.args[3] is weight]
    return found[0] if len(found) == 1 else None
