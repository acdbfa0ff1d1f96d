"""The ``all_gather_keep`` pass: an all-gather that several ops read fuses with its largest GEMM.

A sequence-parallel all-gather whose value other ops read too is left alone by the
``all_gather_linear`` rule (its value would have to exist twice; the pass runs before the rules
and leaves them a gather that one GEMM alone reads). That is the usual case in a
training graph traced by torch.compile: the backward's weight gradients of the column-parallel
GEMMs read the gathered activation, and q/k/v (gate/up) whose weights are stored apart are separate
GEMMs over it. Where fused ops run without autograd (``ctx.without_autograd``: torch.compile's
aten graphs, whose backward is already traced), this pass replaces the gather and the largest GEMM
reading it (a ``BasicLinear`` or a merged ``horizontal_linear``, directly or through a view that
only regroups the token dims) by one :class:`~opfuse.families.collective_linear.keep.AllGatherLinearKeep`:
the gather overlaps that GEMM, and its gathered output feeds every other reader.

``OPFUSE_DISABLE_PASSES=all_gather_keep`` turns it off; ``OPFUSE_FUSE=0`` too.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
from torch import fx

from ...config import config
from ...families.collective_linear.keep import AllGatherLinearKeep
from ...families.horizontal_linear.op import HorizontalLinear
from ...machinery.rewrite import reorder_topologically

__all__ = ["all_gather_keep"]

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)


def _token_view(ctx, node: fx.Node, gathered: fx.Node) -> bool:
    """``node`` reads ``gathered`` through a view that keeps its rows and features (a regrouping of
    the leading token dims, e.g. ``[1, S, H] -> [S, H]``): fused ops treat every leading dim as
    tokens, so a GEMM after it reads the same rows."""
    if node.op != "call_function" or node.target not in _VIEWS or node.args[0] is not gathered:
        return False
    got, want = ctx.meta(node), ctx.meta(gathered)
    if not (got is not None and want is not None and hasattr(got, "shape") and hasattr(want, "shape")):
        return False
    return (len(got.shape) >= 2 and got.shape[-1] == want.shape[-1]
            and math.prod(got.shape) == math.prod(want.shape))


def _gemm(ctx, node: fx.Node, source: fx.Node) -> bool:
    """``node`` is a GEMM this pass can fuse reading ``source`` as its first input."""
    if node.args[:1] != (source,):
        return False
    op = ctx.op(node)
    if ctx.kind(node) == "BasicLinear":
        return getattr(op, "recipe", None) is None  # FP8 GEMMs belong to the FP8 rules
    return isinstance(op, HorizontalLinear) and not op.all_gather


def _weights(ctx, node: fx.Node):
    op = ctx.op(node)
    if isinstance(op, HorizontalLinear):
        return list(op.weights), (list(op.biases) if op.biases is not None else None), op.split
    return [op.weight], None, True


def _candidates(ctx, gather: fx.Node) -> list[fx.Node]:
    readers = [gather] + [u for u in gather.users if _token_view(ctx, u, gather)]
    return [u for r in readers for u in r.users if _gemm(ctx, u, r)]


def _fuse(gm: fx.GraphModule, ctx, gather: fx.Node, gemm: fx.Node) -> None:
    graph = gm.graph
    weights, biases, split = _weights(ctx, gemm)
    module = AllGatherLinearKeep(weights, biases, group=ctx.op(gather).group, split=split)
    with graph.inserting_after(gather):
        fused = graph.call_module(ctx.add_module("fused_all_gather_keep", module), (gather.args[0],))
    record = ctx.record_fusion(fused, [gather, gemm])
    inner = gemm.meta.get("opfuse_covered")
    if inner:  # a merged GEMM: this fusion takes over what it covered (and its record)
        fused.meta["opfuse_covered"] = fused.meta["opfuse_covered"][:1] + list(inner)
        ctx.fusions[:] = [f for f in ctx.fusions if f.fused_node != gemm.name]
        names, kinds = zip(*fused.meta["opfuse_covered"])
        ctx.fusions[ctx.fusions.index(record)] = dataclasses.replace(record, nodes=tuple(names), ops=tuple(kinds))
    # The module returns each y of a split merged GEMM (or the one y), then the gathered value.
    outputs = len(module.sizes) if split and len(module.sizes) > 1 else 1
    if outputs > 1:
        ends = [u for u in gemm.users if u.op == "call_function" and u.target is operator.getitem]
        outs, replaced = tuple(ctx.meta(gemm)), [(end, end.args[1]) for end in ends]
    else:
        ends, outs, replaced = [gemm], (ctx.meta(gemm),), [(gemm, 0)]
    ctx.annotate(fused, (*outs, ctx.meta(gather)), ctx.sharding(gemm))
    cursor = fused
    replaced.append((gather, outputs))
    for old, index in replaced:
        with graph.inserting_after(cursor):
            item = graph.call_function(operator.getitem, (fused, index))
        ctx.annotate(item, ctx.meta(old), ctx.sharding(old))
        item.meta["opfuse_replaces"] = old.meta.get("opfuse_replaces", old.name)
        old.replace_all_uses_with(item)
        cursor = item
    for end in ends:
        if end is not gemm:
            graph.erase_node(end)
    graph.erase_node(gemm)
    graph.erase_node(gather)
    reorder_topologically(graph)


def all_gather_keep(gm: fx.GraphModule, ctx) -> None:
    """Fuse each unfused all-gather with its largest GEMM, keeping the gathered value (docstring)."""
    if not config.fuse or not getattr(ctx, "without_autograd", False):
        return
    for gather in [n for n in gm.graph.nodes if ctx.kind(n) == "AllGather"]:
        gemms = _candidates(ctx, gather)
        if not gemms or (len(gather.users) == 1 and gemms == list(gather.users)):
            continue  # one GEMM reads it and nothing else: the all_gather_linear rule's
        largest = max(gemms, key=lambda n: sum(w.shape[0] for w in _weights(ctx, n)[0]))
        _fuse(gm, ctx, gather, largest)
