"""One dtype cast per value and dtype in the graph.

``torch.autocast`` casts an op's inputs where each op is traced, so a value read by several GEMMs
(the input of q, k and v) is cast once per GEMM: three ``convert_element_type`` nodes of one value.
The rules that merge projections look for GEMMs reading one input node, and would see three.
:func:`merge_duplicate_casts` keeps the first cast of each (value, dtype) and points the readers
of the others at it (a cast is a pure function of its input: the values are the same).
"""

from __future__ import annotations

import torch
from torch import fx

from ..machinery.aten import is_cast_to

__all__ = ["merge_duplicate_casts"]


def merge_duplicate_casts(graph: fx.Graph) -> int:
    """Replace every cast that repeats an earlier one (same input, same dtype) by that one; returns
    how many were removed."""
    first: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
    merged = 0
    for node in list(graph.nodes):
        if not is_cast_to(node) or node.kwargs or len(node.args) != 2 or not isinstance(node.args[0], fx.Node):
            continue
        key = (node.args[0], node.args[1])
        kept = first.setdefault(key, node)
        if kept is node:
            continue
        node.replace_all_uses_with(kept)
        graph.erase_node(node)
        merged += 1
    return merged
