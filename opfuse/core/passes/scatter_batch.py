"""The ``linear_reduce_scatter_batch`` pass: GEMM + reduce-scatter of ``batch > 1`` sequences.

A model that shards ``[batch, seq, hidden]`` along the sequence (DTensor's ``Shard(1)``,
``funcol.reduce_scatter_tensor(y, "sum", 1, group)``) reduce-scatters a row-parallel GEMM's output
after putting its rows rank-major: ``cat(split(y, seq / world, dim=1), dim=0)``. The
``linear_reduce_scatter`` rule sees a ``cat`` before the reduce-scatter, not the GEMM, and leaves
both alone. Where fused ops run inside an aten graph (``ctx.without_autograd``: torch.compile),
this pass replaces ``BasicLinear -> split -> cat -> ReduceScatter`` by one
:class:`~opfuse.families.collective_linear.op.LinearReduceScatter` with ``batch`` set: it reorders
the GEMM's *input* rows (``K`` wide, where the model copied the ``N``-wide output) and overlaps the
GEMM with the scatter like any other ``linear_reduce_scatter``.

``OPFUSE_DISABLE_PASSES=linear_reduce_scatter_batch`` turns it off; ``OPFUSE_FUSE=0`` too.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ...config import config
from ...families.collective_linear.op import LinearReduceScatter
from ...machinery.rewrite import reorder_topologically
from .token_views import RESHAPES

__all__ = ["linear_reduce_scatter_batch"]



def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _chain(ctx, scatter: fx.Node):
    """``(linear, nodes between, batch)`` when ``scatter`` reduces a GEMM's output reordered
    rank-major by ``cat(split(y, chunk, dim=1), dim=0)``; else ``None``."""
    cat = scatter.args[0]
    if not (isinstance(cat, fx.Node) and cat.op == "call_function" and cat.target == torch.ops.aten.cat.default
            and _only_user(cat) is scatter):
        return None
    if (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)) != 0:
        return None
    pieces = list(cat.args[0])
    split = pieces[0].args[0] if pieces and pieces[0].op == "call_function" else None
    if not (isinstance(split, fx.Node) and split.target == torch.ops.aten.split.Tensor
            and (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) == 1):
        return None
    world = ctx.op(scatter).world_size
    if (len(pieces) != world or any(p.target is not operator.getitem or p.args != (split, i) or _only_user(p) is not cat
                                    for i, p in enumerate(pieces)) or len(split.users) != world):
        return None
    linear = split.args[0]
    between = [split, *pieces, cat]
    if (isinstance(linear, fx.Node) and ctx.kind(linear) != "BasicLinear" and linear.op == "call_function"
            and linear.target in RESHAPES and _only_user(linear) is split):
        between.insert(0, linear)  # the GEMM's [rows, n] viewed as [batch, seq, n]
        linear = linear.args[0]
    if not isinstance(linear, fx.Node) or ctx.kind(linear) != "BasicLinear" or _only_user(linear) is not between[0]:
        return None
    if getattr(ctx.op(linear), "recipe", None) is not None:
        return None  # FP8 GEMMs belong to the FP8 rules
    # The op graph holds values as [rows, features]: the GEMM's output is [batch * seq, n], each
    # piece [batch * seq / world, n] (a split along the sequence keeps the features).
    out, piece, chunk = ctx.meta(linear), ctx.meta(pieces[0]), split.args[1]
    if out is None or piece is None or not isinstance(chunk, int) or chunk < 1:
        return None
    if tuple(piece.shape) != (out.shape[0] // world, out.shape[-1]) or out.shape[0] % (world * chunk):
        return None
    return linear, between, out.shape[0] // (world * chunk)


def linear_reduce_scatter_batch(gm: fx.GraphModule, ctx) -> None:
    """Fuse each ``BasicLinear -> split -> cat -> ReduceScatter`` of batch > 1 (module docstring)."""
    if not config.fuse or not getattr(ctx, "without_autograd", False):
        return
    graph = gm.graph
    for scatter in [n for n in graph.nodes if ctx.kind(n) == "ReduceScatter"]:
        found = _chain(ctx, scatter)
        if found is None:
            continue
        linear, between, batch = found
        module = LinearReduceScatter(weight=ctx.op(linear).weight, group=ctx.op(scatter).group, bias_after=True,
                                     batch=batch)
        with graph.inserting_after(scatter):
            fused = graph.call_module(ctx.add_module("fused_linear_reduce_scatter_batch", module), (linear.args[0],))
        ctx.record_fusion(fused, [linear, *between, scatter])
        ctx.annotate(fused, ctx.meta(scatter), ctx.sharding(scatter))
        fused.meta["opfuse_replaces"] = scatter.name
        scatter.replace_all_uses_with(fused)
        for node in [scatter, *reversed(between), linear]:
            graph.erase_node(node)
        reorder_topologically(graph)
