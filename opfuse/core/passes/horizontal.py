"""The ``horizontal_gemm`` pass: GEMMs that read the same value become one GEMM.

Linears that read one value with compatible layouts (gate and up of a gated MLP, q, k and v)
are run as one :class:`~opfuse.families.horizontal_linear.op.HorizontalLinear` over their weights
joined row-wise; its output is split back into the original values, so their users are
unchanged. For a column-parallel layer each rank's joined output is ``[gate_r; up_r]``, exactly
what its gated activation reads, with the same layouts and the same collectives.

What merges:

* ``BasicLinear`` nodes whose first input is the same value, with the same input size, dtype,
  device and weight sharding, and whose weights lie back to back in memory (in some order): the
  joined weight is then a view, so fusing copies nothing. Weights stored apart are left alone
  (copying them on every call would cost more than the second GEMM launch saves) and
  ``explain()`` says so; :func:`opfuse.ops.packing.pack_rows_` stores them together.
* A ``Bias`` that is each member's only user, when every member has one.
* The ``AllGather`` of a sequence-parallel input, when the merged GEMMs are its only users: the
  fused op gathers once, and its ``p2p_overlap`` implementation overlaps the gather with the GEMM.
* A ``GatedActivation(gate, up)`` that is the only user of two merged outputs, in that order: it
  reads the packed ``[gate | up]`` GEMM output directly (``gated_activation``: one pass, no split
  views, and a backward that hands the GEMM one packed gradient).

``OPFUSE_FUSE=0`` (``config.fuse``) turns the pass off with the fusion rules;
``OPFUSE_DISABLE_PASSES=horizontal_gemm`` turns off only this pass.
"""

from __future__ import annotations

import operator

from torch import fx

from ...families.gated_activation.op import PackedGatedActivation
from ...families.horizontal_linear.op import HorizontalLinear
from ...config import config
from ...ops.packing import adjacent, span_key
from ...machinery.rewrite import reorder_topologically

__all__ = ["horizontal_gemm"]


def _key(ctx, node: fx.Node):
    op = ctx.op(node)
    w = op.weight
    return (w.shape[1], w.dtype, w.device, op.weight_sharding, ctx.sharding(node))


def _adjacent_runs(ctx, nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """Maximal runs (>= 2) of ``nodes`` whose weights follow one another in memory."""
    def start(node):
        return span_key(ctx.op(node).weight) or (0, 0)
    ordered = sorted(nodes, key=start)
    runs, current = [], [ordered[0]]
    for node in ordered[1:]:
        if adjacent([ctx.op(current[-1]).weight, ctx.op(node).weight]):
            current.append(node)
        else:
            runs.append(current)
            current = [node]
    runs.append(current)
    return [run for run in runs if len(run) > 1]


def _only_bias(ctx, node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    if len(users) == 1 and ctx.kind(users[0]) == "Bias" and len(users[0].args) == 1:
        return users[0]
    return None


def _gated_consumer(ctx, ends: list[fx.Node]) -> fx.Node | None:
    """The GatedActivation that alone reads ``ends = [gate, up]`` (same shapes), if any."""
    if len(ends) != 2 or len(ends[0].users) != 1 or set(ends[0].users) != set(ends[1].users):
        return None
    (user,) = ends[0].users
    if ctx.kind(user) != "GatedActivation" or tuple(user.args) != tuple(ends):
        return None
    gate, up = (ctx.meta(e) for e in ends)
    return user if gate.shape == up.shape else None


def _fuse_run(gm: fx.GraphModule, ctx, value: fx.Node, run: list[fx.Node]) -> list[fx.Node]:
    """Replace ``run`` (and its biases, and ``value`` when it is an AllGather only they read) by
    one fused node; returns the erased nodes."""
    graph = gm.graph
    biases = [_only_bias(ctx, node) for node in run]
    if not all(biases):
        biases = None
    ends = biases or run
    source, gather, group, covered = value, False, None, []
    if ctx.kind(value) == "AllGather" and set(value.users) == set(run):
        source, gather, group, covered = value.args[0], True, ctx.op(value).group, [value]
    for index, node in enumerate(run):
        covered.append(node)
        if biases:
            covered.append(biases[index])
    activation = _gated_consumer(ctx, ends)
    module = HorizontalLinear([ctx.op(n).weight for n in run], [ctx.op(b).bias for b in biases] if biases else None,
                              all_gather=gather, group=group, split=activation is None)
    target = ctx.add_module("fused_horizontal_gemm", module)
    position = {node: i for i, node in enumerate(graph.nodes)}
    before = min(covered, key=position.__getitem__).prev  # the rewrite touches the graph from here on
    last = max(covered, key=position.__getitem__)
    with graph.inserting_after(last):
        fused = graph.call_module(target, (source,))
    ctx.record_fusion(fused, covered)
    if activation is None:
        ctx.annotate(fused, tuple(ctx.meta(end) for end in ends), ctx.sharding(ends[0]))
        cursor = fused
        for index, end in enumerate(ends):
            with graph.inserting_after(cursor):
                item = graph.call_function(operator.getitem, (fused, index))
            ctx.annotate(item, ctx.meta(end), ctx.sharding(end))
            item.meta["opfuse_replaces"] = end.name  # the value the torch.compile lowering rewires
            end.replace_all_uses_with(item)
            cursor = item
        through = cursor
    else:
        half = ctx.meta(ends[0])
        packed = half.with_(shape=half.shape[:-1] + (2 * half.shape[-1],),
                            requires_grad=any(ctx.meta(e).requires_grad for e in ends))
        ctx.annotate(fused, packed, ctx.sharding(ends[0]))
        with graph.inserting_after(fused):
            gated = graph.call_module(ctx.add_module("fused_gated_activation",
                                                     PackedGatedActivation(ctx.op(activation).activation)), (fused,))
        ctx.annotate(gated, ctx.meta(activation), ctx.sharding(activation))
        gated.meta["opfuse_replaces"] = activation.name
        ctx.record_fusion(gated, [activation])
        activation.replace_all_uses_with(gated)
        graph.erase_node(activation)
        through = gated
    for node in reversed(covered):
        graph.erase_node(node)
    reorder_topologically(graph, before, through)
    return covered + ([activation] if activation is not None else [])


def horizontal_gemm(gm: fx.GraphModule, ctx) -> None:
    """Merge the linears that read the same value (module docstring)."""
    if not config.fuse:
        return
    erased: set[fx.Node] = set()
    for value in list(gm.graph.nodes):
        if value in erased:
            continue  # an AllGather absorbed by an earlier merge
        # FP8 GEMMs (under fp8.autocast) are left to the FP8 rules.
        linears = [u for u in value.users if ctx.kind(u) == "BasicLinear" and u.args[0] is value
                   and getattr(ctx.op(u), "recipe", None) is None]
        if len(linears) < 2:
            continue
        groups: dict = {}
        for node in linears:
            groups.setdefault(_key(ctx, node), []).append(node)
        for members in groups.values():
            if len(members) < 2:
                continue
            runs = _adjacent_runs(ctx, members)
            merged = {n for run in runs for n in run}
            apart = [n.name for n in members if n not in merged]
            if apart and all(ctx.op(n).weight.is_meta for n in members):
                # Stand-ins of a torch.compile graph's inputs: where the weights live is not known.
                ctx.note(f"{', '.join(apart)} read {value.name} as other GEMMs do, but their weights are separate "
                         f"inputs of the compiled graph: merging them would copy the weights on every call")
            elif apart:
                ctx.note(f"{', '.join(apart)} read {value.name} as other GEMMs do, but their weights are stored "
                         f"apart in memory: merging them would copy the weights on every call (keep them in one "
                         f"buffer: opfuse.ops.packing.pack_rows_)")
            for run in runs:
                erased.update(_fuse_run(gm, ctx, value, run))
