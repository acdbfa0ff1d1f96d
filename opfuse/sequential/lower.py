"""Lowering an ``ops.Sequential`` to a torch.fx graph: one ``call_module`` node per op, extra
inputs as placeholders, extra outputs as outputs.

Every value carries its :class:`~opfuse.ops.TensorMeta` (``node.meta["opfuse_meta"]``) and its
:class:`~opfuse.ops.Sharding` (``node.meta["opfuse_sharding"]``). Computing them validates the
user's block op by op, layouts first: a layout error is a ``PartitionError`` naming the op, never
a shape error about a per-rank size that follows from it. A composite op (``Linear``) gets its
metadata from the basic ops it expands into for the actual input layout.
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

from ..ops.base import OpInputError, TensorMeta, output_meta
from ..ops.expansion import evaluate
from ..ops.sharding import REPLICATED
from ..machinery.rewrite import snake_case

__all__ = ["lower", "block_input_sharding"]


class _Root(nn.Module):
    """The owner of a program's submodules (the user's ops, shared, plus fused ones)."""


def block_input_sharding(ops, meta: TensorMeta, extras=()):
    """Layout of the block's main input: what the first op that states a preference expects of
    the value it receives, when the ops before it hand that layout through unchanged.

    The ops before it are followed as they transform the value (``Linear(4, 2)`` and ``SwiGLU``
    change its width, which decides whether a row-parallel layer sees a full-width replicated
    value or a feature shard). If they cannot take the preferred layout (a feature shard into an
    unsharded ``Linear`` or a ``SwiGLU``), the block's input is replicated and lowering reports
    the op that cannot take what it receives. ``extras``: the extra inputs' metadata, in order.
    """
    pending = iter(extras)
    before = []
    for op in ops:
        natural = op.natural_input_sharding(meta)
        if natural is not None:
            return natural if _hands_through(before, natural) else REPLICATED
        try:
            taken = [next(pending) for _ in range(op.num_extra_inputs)]
            meta = output_meta(op, meta, *taken)
        except (OpInputError, StopIteration):
            return REPLICATED  # lowering names the op and its input (or the missing extra input)
        before.append(op)
    return REPLICATED


def _hands_through(ops, sharding) -> bool:
    """``ops`` (the ones before the op that prefers ``sharding``) take a value laid out as
    ``sharding`` (extra inputs laid out alike) and give it back laid out the same way."""
    for op in ops:
        try:
            if getattr(op, "is_composite", False):
                _, out = op.expand(sharding)
            else:
                out = op.propagate_sharding(sharding, *[sharding] * op.num_extra_inputs)
        except OpInputError:
            return False
        if out != sharding:
            return False
    return True


def _meta_and_sharding(op, args):
    metas = [a.meta["opfuse_meta"] for a in args]
    shardings = [a.meta["opfuse_sharding"] for a in args]
    if getattr(op, "is_composite", False):
        basics, out = op.expand(shardings[0])
        check = getattr(op, "check_input", None)  # a composite's own words for a bad input width
        if check is not None:
            check(metas[0], shardings[0])
        try:
            meta = evaluate(basics, metas[0], metas[1:], lambda step, args, taken: output_meta(step.op, *args, *taken))
        except OpInputError as error:
            raise type(error)(f"{op.describe()}: {error}") from None
        return meta, out
    out = op.propagate_sharding(*shardings)
    try:
        return output_meta(op, *metas), out
    except OpInputError as error:
        if len(args) > 1 and not shardings[0].replicated:
            # Per-rank shapes follow from the layout: say which one the extra input must have.
            raise type(error)(f"{error} (the value here is {shardings[0].describe()} over its process group, and an "
                              f"extra input is laid out like the value it meets: pass this rank's part)") from None
        raise


def lower(seq, inputs: tuple[torch.Tensor, ...]) -> fx.GraphModule:
    """Build the op graph of ``seq`` for ``inputs`` (tensors or :class:`TensorMeta`)."""
    metas = [i if isinstance(i, TensorMeta) else TensorMeta.of(i) for i in inputs]
    root = _Root()
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["opfuse_meta"] = metas[0]
    x.meta["opfuse_sharding"] = block_input_sharding(list(seq), metas[0], metas[1:])
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
        for extra in args[1:]:
            # An extra input (residual, group sizes) is laid out like the value it meets.
            extra.meta["opfuse_sharding"] = value.meta["opfuse_sharding"]
        node = graph.call_module(name, tuple(args))
        node.meta["opfuse_path"] = str(index)
        try:
            meta, sharding = _meta_and_sharding(op, args)
        except OpInputError as error:
            raise type(error)(f"Sequential op {index}: {error}") from None
        node.meta["opfuse_sharding"] = sharding
        if op.num_extra_outputs and not getattr(op, "extra_output_is_main", False):
            # Ops returning (y, *extras): split with getitem so each value is one node.
            items = [graph.call_function(operator.getitem, (node, k)) for k in range(1 + op.num_extra_outputs)]
            for item in items:
                item.meta["opfuse_meta"] = meta
                item.meta["opfuse_sharding"] = sharding
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
