"""The op graph of an aten graph: the same torch.fx form ``ops.Sequential`` lowers to (one
``call_module`` node per opfuse op, every value annotated with its ``TensorMeta``), so the pass
pipeline, the built-in and user rules, ``explain()`` and the dumps work on it unchanged. Values
are described as opfuse's ops take them, ``[tokens, features]``: a model's ``[batch, seq,
features]`` activation shows as ``[batch * seq, features]``.

Every aten node that is not part of a recognised region is copied as it is (an "opaque" node,
kind ``call_function``): the matcher needs every user of every value, and every path through
unrecognised code, to decide whether a match is legal (no interior value used elsewhere, no
cycle). Interior values of a region that other nodes read (a norm's ``rsqrt`` that the backward
half of a joint graph uses) are copied too, computed from the region's inputs: that is what
stays in the graph after fusion, recomputed from the fused op's outputs.

Where a norm's input has other users (the residual stream continues past the norm, or the norm's
recomputed statistics read it), a ``MakeExtraOutput`` is placed between them, as a block written
with ``ops.Sequential`` would have it: the rules then export that value from the fused op.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx, nn

from ..ops.base import OpInputError, TensorMeta
from ..ops.extra import MakeExtraOutput
from ..ops.sharding import REPLICATED, Sharding
from ..core.rules import get_registry
from ..machinery.rewrite import add_submodule, snake_case
from ..machinery.aten import is_static_size
from ..machinery.aten import value as fake_value
from .recognition import find_regions
from ..machinery.region import ParamSource, Region, recompute_closure

__all__ = ["OpGraph", "OpGraphModule", "build_op_graph", "param_source", "tensor_meta"]


class _Root(nn.Module):
    """Owner of an op graph's modules (the recognised ops, then the fused ones)."""


class OpGraphModule(fx.GraphModule):
    """An op graph. It is never run (its aten graph is), so the pass pipeline's recompiles only
    mark its Python code stale; ``code`` generates it when asked (seconds for a large model)."""

    #: Its op modules never run (the aten graph does): passes that only change how the modules
    #: compute (the cleanup pass's folding) leave it alone.
    runs_modules = False

    def recompile(self):
        self._opfuse_stale = True

    @property
    def code(self) -> str:
        if getattr(self, "_opfuse_stale", True):
            fx.GraphModule.recompile(self)
            self._opfuse_stale = False
        return fx.GraphModule.code.fget(self)


@dataclasses.dataclass
class OpGraph:
    """An aten graph's op graph and how its nodes map back.

    ``aten``: op-graph node name -> the aten node holding its value (``None`` for a value that
    exists only in the op graph, the GEMM half of an ``addmm``). ``regions``: op-graph node
    name -> the region of a recognised op. ``params``: ``id`` of a stand-in parameter -> its
    source (the ops in ``gm`` keep the parameters alive).
    """

    gm: fx.GraphModule
    aten: dict[str, fx.Node | None]
    regions: dict[str, Region]
    params: dict
    notes: list[str]


def tensor_meta(val) -> TensorMeta | tuple | None:
    """``TensorMeta`` of a fake tensor as opfuse's ops see it, ``[tokens, features]`` (leading
    dims flattened; tuples of them for multi-output nodes). A graph compiled for several sequence
    lengths keeps its token count symbolic (a ``torch.SymInt``: never turned into an int, which
    would specialise the graph to the length it was traced with)."""
    if isinstance(val, torch.Tensor):
        dims = tuple(_size(s) for s in val.shape)
        if len(dims) > 2:
            dims = (_numel(dims[:-1]), dims[-1])
        return TensorMeta(dims, val.dtype, val.device)
    if isinstance(val, (tuple, list)):
        return tuple(tensor_meta(v) for v in val)
    return None


def _numel(dims) -> int:
    count = 1
    for size in dims:
        count *= size
    return count


def _size(size):
    if isinstance(size, torch.SymInt):
        constant = size.node.maybe_as_int()
        return size if constant is None else constant
    return size


def _static_features(val) -> bool:
    """Whether ``val``'s feature (last) dim is a fixed size: the ops' parameters and the fused
    kernels' row layouts depend on it; the leading (token) dims may vary between calls."""
    if isinstance(val, torch.Tensor):
        return val.dim() == 0 or is_static_size(_size(val.shape[-1]))
    if isinstance(val, (tuple, list)):
        return all(_static_features(v) for v in val)
    return True


def _annotate(node: fx.Node, meta, sharding: Sharding = REPLICATED) -> None:
    node.meta["opfuse_meta"] = meta
    node.meta["opfuse_sharding"] = sharding


def _inferred_metas(regions: list[Region], notes: list[str]) -> dict[int, TensorMeta]:
    """What each region's op computes from its inputs' metadata (what verify checks the op graph
    against); regions whose op refuses its inputs are left out (their nodes stay opaque, and
    ``notes`` says why, for ``explain()``)."""
    metas: dict[int, TensorMeta] = {}
    pending = None  # the GEMM half of an addmm, for its bias half
    for region in regions:
        if region.virtual_input:
            inputs = [pending] if pending is not None else None
        else:
            inputs = [tensor_meta(fake_value(i)) for i in region.inputs]
        pending = None
        if inputs is None or not all(isinstance(m, TensorMeta) for m in inputs):
            continue
        try:
            meta = region.op.infer_meta(*inputs)
        except OpInputError as error:
            where = region.position.name
            notes.append(f"{where}: recognised as {region.kind}, left unfused: {error}")
            continue
        if region.value is None:
            pending = meta
        metas[id(region)] = meta
    return metas


def _extra_output_kinds() -> tuple[set[str], set[str]]:
    """``(exporting, reading)``: the kinds the active rules' patterns place right before a
    ``MakeExtraOutput`` (the values a fused op can export) and right after it (the ops, norms in the
    built-in rules, whose input a fused op can also export)."""
    exporting, reading = set(), set()
    for rule in get_registry().active():
        for variant in rule.variants:
            for src, dst, _ in variant.edges:
                if "MakeExtraOutput" in variant.spec(dst).kinds:
                    exporting.update(variant.spec(src).kinds)
                if "MakeExtraOutput" in variant.spec(src).kinds:
                    reading.update(variant.spec(dst).kinds)
    return exporting, reading


def _insert_extra_outputs(gm: fx.GraphModule, aten: dict) -> None:
    """``V -> [MakeExtraOutput] -> op`` wherever the input ``V`` of an op that a rule reads after a
    ``MakeExtraOutput`` (a norm) has other users and is the value of an op a rule could fuse and
    export (an all-reduce, a bias, a residual add)."""
    graph = gm.graph
    exporting, reading = _extra_output_kinds()
    for node in list(graph.nodes):
        if node.op != "call_module" or gm.get_submodule(node.target).kind not in reading:
            continue
        source = node.args[0]
        if not isinstance(source, fx.Node) or source.op != "call_module" or len(source.users) < 2:
            continue
        if gm.get_submodule(source.target).kind not in exporting:
            continue
        name = add_submodule(gm, f"make_extra_output_{source.name}", MakeExtraOutput())
        with graph.inserting_after(source):
            extra = graph.call_module(name, (source,))
        _annotate(extra, source.meta["opfuse_meta"], source.meta["opfuse_sharding"])
        source.replace_all_uses_with(extra, delete_user_cb=lambda user: user is not extra)
        aten[extra.name] = aten[source.name]


def build_op_graph(aten_gm: fx.GraphModule, exclude=frozenset()) -> OpGraph:
    """The op graph of ``aten_gm`` (see the module docstring); nodes of ``exclude`` stay opaque."""
    notes = []
    regions = find_regions(aten_gm.graph, exclude)
    static = []
    for region in regions:
        if all(_static_features(fake_value(n)) for n in (*region.inputs, region.value) if n is not None):
            static.append(region)
    if len(static) < len(regions):
        notes.append(f"{len(regions) - len(static)} op(s) with a symbolic feature (last) dim left unfused: "
                     f"opfuse's ops take varying token counts, not varying feature sizes (mark only the "
                     f"sequence dim dynamic, e.g. torch._dynamo.mark_dynamic(x, 1))")
    metas = _inferred_metas(static, notes)
    regions = [r for r in static if id(r) in metas]
    at_position: dict[fx.Node, list[Region]] = {}
    for region in regions:
        at_position.setdefault(region.position, []).append(region)
    interior = {n for region in regions for n in region.nodes}
    recomputed = set()
    for region in regions:
        recomputed |= recompute_closure(region) or set()

    root = _Root()
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    aten: dict[str, fx.Node | None] = {}
    by_name: dict[str, Region] = {}
    params: dict = {}
    pending_virtual = None

    def mapped(arg):
        return fx.node.map_arg(arg, lambda n: env[n])

    for node in aten_gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            copy = graph.placeholder(node.name)
            _annotate(copy, tensor_meta(fake_value(node)))
            env[node] = copy
            aten[copy.name] = node
            continue
        if node.op == "output":
            graph.output(mapped(node.args[0]))
            continue
        placed = at_position.get(node, [])
        # Opaque: not part of an op, or an op's interior value that stays for others to read.
        if node not in interior or (node in recomputed and not any(r.value is node for r in placed)):
            copy = graph.create_node(node.op, node.target, mapped(node.args), mapped(node.kwargs), name=node.name)
            _annotate(copy, tensor_meta(fake_value(node)))
            env[node] = copy
            aten[copy.name] = node
        for region in placed:
            if region.virtual_input:
                args = (pending_virtual,)
            else:
                args = tuple(env[i] for i in region.inputs)
            target = f"{snake_case(region.kind)}_{region.position.name}"
            root.add_module(target, region.op)
            op_node = graph.call_module(target, args)
            if region.value is None:
                pending_virtual = op_node
            else:
                env[region.value] = op_node
            _annotate(op_node, metas[id(region)])
            op_node.meta["opfuse_path"] = (region.value or region.anchor).name
            aten[op_node.name] = region.value
            by_name[op_node.name] = region
            params.update({id(p): source for p, source in region.params.items()})
    gm = OpGraphModule(root, graph, class_name="OpfuseOpGraph")
    _insert_extra_outputs(gm, aten)
    gm.recompile()
    return OpGraph(gm, aten, by_name, params, notes)


def param_source(op_graph: OpGraph, param) -> ParamSource:
    """The graph input stand-in parameter ``param`` stands for."""
    try:
        return op_graph.params[id(param)]
    except KeyError:
        raise KeyError(f"opfuse: parameter of shape {list(param.shape)} is not a stand-in of this graph's ops "
                       f"(a rule built a fused op from parameters it did not take from the match)") from None
