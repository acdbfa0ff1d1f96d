"""The ``all_gather_keep`` pass: an all-gather that several ops read fuses with its largest GEMM.

A sequence-parallel all-gather whose value other ops read too is left alone by the
``all_gather_linear`` rule (its value would have to exist twice; the pass runs before the rules
and leaves them a gather that one GEMM alone reads). That is the usual case in a
training graph traced by torch.compile: the backward's weight gradients of the column-parallel
GEMMs read the gathered activation, and q/k/v (gate/up) whose weights are stored apart are separate
GEMMs over it. Where fused ops run without autograd (``ctx.without_autograd``: torch.compile's
aten graphs, whose backward is already traced), this pass replaces the gather and the largest GEMM
reading it (a ``BasicLinear`` or a merged ``horizontal_linear``, directly, through a view that
only regroups the token dims, or after the ``split`` + ``cat`` that puts a sequence-sharded gather
of ``batch > 1`` sequences back in batch-major order) by one :class:`~opfuse.families.collective_linear.keep.AllGatherLinearKeep`:
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
from .sequence_batch import batch_fusion_refused
from .token_views import token_view

__all__ = ["all_gather_keep"]

def _token_view(ctx, node: fx.Node, gathered: fx.Node) -> bool:
    """``node`` reads ``gathered`` through a view that keeps its rows and features (a regrouping of
    the leading token dims, e.g. ``[1, S, H] -> [S, H]``): fused ops treat every leading dim as
    tokens, so a GEMM after it reads the same rows."""
    return node.args[:1] == (gathered,) and token_view(node, ctx.meta)


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


def _batch_regroup(ctx, gather: fx.Node) -> tuple[fx.Node, int] | None:
    """``(cat, batch)`` when ``gather`` (rank-major ``[world * batch, seq, ...]`` rows, what an
    all-gather along dim 0 of ``[batch, seq, ...]`` shards gives) is regrouped into ``[batch, world * seq, ...]``
    by ``cat(split(gather, batch), dim=1)``: how a sequence-sharded all-gather (DTensor's
    ``Shard(1)`` -> ``Replicate()``, ``funcol.all_gather_tensor(x, 1, ...)``) reads at batch > 1."""
    meta, world = ctx.meta(gather), ctx.op(gather).world_size
    for split in gather.users:
        if split.op != "call_function" or split.target != torch.ops.aten.split.Tensor:
            continue
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        pieces = sorted((u for u in split.users if u.target is operator.getitem), key=lambda u: u.args[1])
        if dim != 0 or len(pieces) < 2 or any(u.args[1] != i for i, u in enumerate(pieces)):
            continue
        cats = {c for u in pieces for c in u.users}
        if len(cats) != 1 or any(len(u.users) != 1 for u in pieces):
            continue
        (cat,) = cats
        cat_dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        if cat.target != torch.ops.aten.cat.default or list(cat.args[0]) != pieces or cat_dim != 1:
            continue
        # The op graph holds every value as [rows, features]: a piece of [batch, seq, ...] is
        # [batch * seq, features], and joining the pieces along the sequence dim gives world times
        # its rows with the same features (a concatenation of features would widen them instead).
        batch, piece, joined = split.args[1], ctx.meta(pieces[0]), ctx.meta(cat)
        if not (isinstance(batch, int) and batch >= 1 and meta is not None and piece is not None
                and joined is not None and len(piece.shape) == 2 and piece.shape[0] % batch == 0
                and tuple(joined.shape) == (len(pieces) * piece.shape[0], piece.shape[1])
                and math.prod(meta.shape) == len(pieces) * math.prod(piece.shape)):
            continue
        if world != len(pieces):
            continue
        return cat, batch
    return None


def _candidates(ctx, gather: fx.Node) -> list[tuple[fx.Node, int]]:
    """``(GEMM, batch)`` of every GEMM reading ``gather``'s rows: directly or through token views
    (``batch`` 1), or in batch-major order after a :func:`_batch_regroup` (``batch`` > 1)."""
    found = []
    sources = [(gather, 1)]
    regroup = _batch_regroup(ctx, gather)
    if regroup is not None and not batch_fusion_refused(ctx, gather, "all-gather + GEMM"):
        sources.append(regroup)
    for source, batch in sources:
        readers = [source] + [u for u in source.users if _token_view(ctx, u, source)]
        found += [(u, batch) for r in readers for u in r.users if _gemm(ctx, u, r)]
    return found


def _fuse(gm: fx.GraphModule, ctx, gather: fx.Node, gemm: fx.Node, batch: int) -> None:
    graph = gm.graph
    weights, biases, split = _weights(ctx, gemm)
    module = AllGatherLinearKeep(weights, biases, group=ctx.op(gather).group, split=split, batch=batch)
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
        if not gemms or (len(gather.users) == 1 and [g for g, _ in gemms] == list(gather.users)):
            continue  # one GEMM reads it and nothing else: the all_gather_linear rule's
        largest, batch = max(gemms, key=lambda item: sum(w.shape[0] for w in _weights(ctx, item[0])[0]))
        _fuse(gm, ctx, gather, largest, batch)
