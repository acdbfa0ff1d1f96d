"""Lowering an ``ops.Sequential`` to a torch.fx graph: one ``call_module`` node per op, extra
inputs as placeholders, extra outputs as outputs. Every value carries its
:class:`~opfuse.ops.TensorMeta` in ``node.meta["opfuse_meta"]``; computing those validates the
user's inputs op by op, with errors that name the op."""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

from ..ops.base import OpInputError, TensorMeta
from ..passes.rewrite import snake_case

__all__ = ["lower"]


class _Root(nn.Module):
    """The owner of a program's submodules (the user's ops, shared, plus fused ones)."""


def lower(seq, inputs: tuple[torch.Tensor, ...]) -> fx.GraphModule:
    """Build the op graph of ``seq`` for ``inputs`` (tensors or :class:`TensorMeta`)."""
    metas = [i if isinstance(i, TensorMeta) else TensorMeta.of(i) for i in inputs]
    root = _Root()
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["opfuse_meta"] = metas[0]
    extra_nodes = []
    owners = [(index, op) for index, op in enumerate(seq) for _ in range(op.num_extra_inputs)]
    for position, (index, op) in enumerate(owners):
        node = graph.placeholder(f"extra{position}_{snake_case(op.kind)}{index}")
        node.meta["opfuse_meta"] = metas[1 + position]
        extra_nodes.append(node)

    value = x
    pending = iter(extra_nodes)
    outputs = []
    for index, op in enumerate(seq):
        name = f"op{index}_{snake_case(op.kind)}"
        root.add_module(name, op)
        args = [value] + [next(pending) for _ in range(op.num_extra_inputs)]
        node = graph.call_module(name, tuple(args))
        node.meta["opfuse_path"] = str(index)
        try:
            meta = op.infer_meta(*(a.meta["opfuse_meta"] for a in args))
        except OpInputError as error:
            raise OpInputError(f"Sequential op {index}: {error}") from None
        if op.num_extra_outputs and not getattr(op, "extra_output_is_main", False):
            # Ops returning (y, *extras): split with getitem so each value is one node.
            items = [graph.call_function(operator.getitem, (node, k)) for k in range(1 + op.num_extra_outputs)]
            for item in items:
                item.meta["opfuse_meta"] = meta
            node.meta["opfuse_meta"] = meta
            value = items[0]
            outputs.extend(items[1:])
            continue
        node.meta["opfuse_meta"] = meta
        if op.num_extra_outputs:
            outputs.append(node)
        value = node
    graph.output((value, *outputs))
    return fx.GraphModule(root, graph, class_name="OpfuseProgram")
