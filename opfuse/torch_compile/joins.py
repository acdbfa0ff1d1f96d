"""Concatenations of graph inputs that lie back to back: views, not copies.

``torch.cat([w_0, ..., w_n])`` of parameters stored one after another in one buffer is that
buffer's rows: the rewritten MoE blocks (:mod:`.moe`) stack their experts' weights this way, and
models that concatenate their own q/k/v weights do too. In eager PyTorch ``cat`` copies; here, when
the inputs' fake tensors say they are adjacent (Dynamo and AOTAutograd keep the aliasing of
inputs that are views of one storage), the ``cat`` becomes ``as_strided`` of the first input, a
view. The backward is unchanged (each input's gradient is its slice of the concatenation's).
The compiled graph then relies on the inputs staying where they are: :mod:`.layout_guard`
checks that before each call.
"""

from __future__ import annotations

import torch
from torch import fx

from ..machinery.aten import aten, calls, value
from ..ops.packing import adjacent

__all__ = ["view_adjacent_concatenations"]


def view_adjacent_concatenations(graph: fx.Graph) -> int:
    """Replace each ``cat`` (dim 0) / ``stack`` (dim 0) of adjacent graph inputs by a view of the
    first; returns how many were replaced."""
    replaced = 0
    for node in list(graph.nodes):
        if calls(node, aten.cat.default):
            stacking = False
        elif calls(node, aten.stack.default):
            stacking = True
        else:
            continue
        parts = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if dim != 0 or len(parts) < 2 or not all(isinstance(p, fx.Node) and p.op == "placeholder" for p in parts):
            continue
        vals = [value(p) for p in parts]
        if not all(isinstance(v, torch.Tensor) for v in vals):
            continue
        if stacking and any(v.shape != vals[0].shape for v in vals):
            continue
        if not adjacent(vals if not stacking else [v.unsqueeze(0) for v in vals]):
            continue
        out = value(node)
        first = vals[0]
        stride = list(torch.empty(out.shape, device="meta").stride())
        with graph.inserting_before(node):
            view = graph.call_function(aten.as_strided.default, (parts[0], list(out.shape), stride,
                                                                 first.storage_offset()))
        view.meta.update(node.meta)
        view.meta["val"] = aten.as_strided.default(first, list(out.shape), stride, first.storage_offset())
        node.replace_all_uses_with(view)
        graph.erase_node(node)
        replaced += 1
    return replaced
