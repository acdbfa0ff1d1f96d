"""The FP8 step of partitioning (under :func:`opfuse.fp8.autocast`): every GEMM becomes an FP8 GEMM
and its input activation is quantized by a ``Quantize`` op.

Where the ``Quantize`` goes: in front of the GEMM, moved up past the ops that only move its input
(``AllGather``, ``GradAllReduce``, and the views of a traced graph that only regroup the token
dims, ``[1, S, H] -> [S, H]``, between them and the GEMM) so that what they move is FP8, where
every op reading the moved value is a GEMM that becomes FP8 too (q, k and v reading one
all-gathered activation). An all-gathered activation with one scale per tensor gets a scale shared
by the group's ranks (the amax is all-reduced), so the gathered tensor has one scale too; with one
scale per row each row travels with its own.
``GroupedLinear`` quantizes its input inside the grouped GEMM (one scale per tensor must ignore the
rows past ``sum(group_sizes)``, which only the grouped op knows).

GEMMs that read the same value share one ``Quantize`` (q, k and v of an attention block: the norm
before them emits FP8 once). ``ctx.fp8_exempt`` (node name -> reason; the torch.compile front
end fills it from ``fp8_filter`` and from what it could not convert) keeps chosen GEMMs in high
precision.

It runs at the end of the partition pass, so the partitioned graph (``OPFUSE_DUMP``:
``01_partition.py``; ``Program.dump(graph="unfused")``) is the unfused FP8 program: every op in it
has a reference that emulates the FP8 numerics in float32, which the passes and fusion rules after
it start from (``horizontal_gemm`` leaves FP8 GEMMs alone).
"""

from __future__ import annotations

from torch import fx

from ...ops import group as groups
from ...ops.base import output_meta
from ...ops.collectives import AllGather, GradAllReduce
from ...ops.grouped import BasicGroupedLinear
from ...ops.linear import BasicLinear
from ...ops.quantize import Quantize
from ...machinery.rewrite import add_submodule
from .token_views import token_view

__all__ = ["insert_fp8"]

#: Ops a Quantize moves in front of (they move the value without computing on it).
_MOVERS = (AllGather, GradAllReduce)


def _op(gm: fx.GraphModule, node) -> object:
    return gm.get_submodule(node.target) if isinstance(node, fx.Node) and node.op == "call_module" else None


def _swap_module(gm: fx.GraphModule, node: fx.Node, module) -> None:
    node.target = add_submodule(gm, f"{node.target}_fp8", module)


def _shared_quantize(gm: fx.GraphModule, source: fx.Node, op: Quantize) -> fx.Node | None:
    """A ``Quantize`` of ``source`` with ``op``'s settings that another GEMM's input already has."""
    for user in source.users:
        other = _op(gm, user)
        if (isinstance(other, Quantize) and (other.dtype, other.rowwise) == (op.dtype, op.rowwise)
                and other.amax_group is op.amax_group):
            return user
    return None


def _read_by_fp8_gemms(gm: fx.GraphModule, value: fx.Node, converts) -> bool:
    """Every reader of ``value`` is a GEMM that becomes FP8 reading it as its input
    (``converts(node)``), a ``Quantize`` of it, or a token view read only that way: moving the
    ``Quantize`` above ``value`` changes what nobody else reads."""
    for user in value.users:
        if isinstance(_op(gm, user), Quantize):
            continue
        if converts(user) and user.args[:1] == (value,):
            continue
        if token_view(user) and _read_by_fp8_gemms(gm, user, converts):
            continue
        return False
    return True


def _quantize_input(gm: fx.GraphModule, gemm: fx.Node, recipe, converts=None) -> None:
    """Insert ``Quantize`` on the GEMM's input, above the movers that feed it (or reuse the one
    another GEMM reading the same value got). ``converts(node)``: whether GEMM ``node`` becomes
    FP8 too (a mover read by several GEMMs is moved past only if every one does)."""
    chain = [gemm]
    source = gemm.args[0]
    while isinstance(source, fx.Node) and (isinstance(_op(gm, source), _MOVERS) or token_view(source)):
        if len(source.users) != 1 and (converts is None or not _read_by_fp8_gemms(gm, source, converts)):
            break
        chain.append(source)
        source = source.args[0]
    while len(chain) > 1 and _op(gm, chain[-1]) is None:
        source = chain.pop()  # a view with no mover above it: the Quantize stays below it, by the GEMM
    if source.meta["opfuse_meta"].quantized is not None:
        return  # already FP8 (a Quantize the user placed, or the one a GEMM reading the same value got)
    gathers = [_op(gm, n) for n in chain if isinstance(_op(gm, n), AllGather)]
    # The gather's group, resolved: ``None`` would mean "no group" to Quantize.
    op = Quantize.for_recipe(recipe, amax_group=groups.resolve(gathers[0].group, "AllGather") if gathers else None)
    first = chain[-1]
    shared = _shared_quantize(gm, source, op)
    if shared is not None:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        if order[shared] > order[first]:
            first.prepend(shared)  # read earlier than by the GEMM it was made for
        first.replace_input_with(source, shared)
        _refresh_movers(gm, chain)
        return
    with gm.graph.inserting_before(first):
        node = gm.graph.call_module(add_submodule(gm, f"{gemm.name}_quantize", op), (source,))
    node.meta.update(opfuse_meta=output_meta(op, source.meta["opfuse_meta"]),
                     opfuse_sharding=source.meta["opfuse_sharding"],
                     opfuse_path=gemm.meta.get("opfuse_path", gemm.name) + ".quantize")
    first.replace_input_with(source, node)
    _refresh_movers(gm, chain)


def _refresh_movers(gm: fx.GraphModule, chain: list[fx.Node]) -> None:
    """The movers now carry FP8: recompute their metadata (the GEMM's output is unchanged)."""
    for mover in reversed(chain[1:]):
        metas = [a.meta["opfuse_meta"] for a in mover.args if isinstance(a, fx.Node)]
        if _op(gm, mover) is None:  # a token view: its shape, its input's encoding
            mover.meta["opfuse_meta"] = mover.meta["opfuse_meta"].with_(quantized=metas[0].quantized)
        else:
            mover.meta["opfuse_meta"] = output_meta(_op(gm, mover), *metas)


def insert_fp8(gm: fx.GraphModule, ctx) -> None:
    """Make every ``BasicLinear`` / ``BasicGroupedLinear`` an FP8 GEMM of ``ctx.recipe`` and quantize
    the linear GEMMs' inputs (no-op outside autocast)."""
    recipe = getattr(ctx, "recipe", None)
    if recipe is None:
        return
    exempt = getattr(ctx, "fp8_exempt", None) or {}

    def converts(node: fx.Node) -> bool:
        op = _op(gm, node)
        return isinstance(op, BasicLinear) and node.name not in exempt and op.recipe in (None, recipe)

    for node in list(gm.graph.nodes):
        op = _op(gm, node)
        if node.name in exempt:
            continue
        if isinstance(op, BasicLinear) and op.recipe is None:
            _swap_module(gm, node, op.with_recipe(recipe))
            _quantize_input(gm, node, recipe, converts)
        elif isinstance(op, BasicGroupedLinear) and op.recipe is None:
            _swap_module(gm, node, op.with_recipe(recipe))
    gm.delete_all_unused_submodules()
