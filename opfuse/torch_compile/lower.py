"""Lowering the fusions of an op graph back into its aten graph: each fused op becomes the call to
its custom op (``torch.ops.opfuse.<name>``, with the implementation the select pass chose), the
values it replaces are rewired to its outputs, and the aten nodes it covers disappear.

The custom-op call is obtained by tracing the fused module's own ``forward`` with ``make_fx`` on
the graph's fake tensors, its stand-in parameters bound to the graph inputs they stand for: any
fused module whose forward calls a ``torch.library`` custom op lowers this way, the built-in ones
and those of user rules alike.

Covered nodes that something outside the fusion still reads (a norm's statistics that the
backward half of a joint graph uses) stay and now compute from the fused op's outputs: the
exported pre-norm sum replaces the value they read. Every collective a fusion covers must be gone
afterwards (checked: a collective that ran twice would cost what fusion saves).
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from ..machinery.fused_op import FusedOp
from ..machinery.aten import c10d, calls, is_static_size, known_equal, same_shape
from ..machinery.aten import value as fake_value
from .op_graph import OpGraph, param_source
from .reference_fusions import fused_values
from .view_layouts import refresh_layouts, same_layout

__all__ = ["LoweringError", "lower_fusions", "trace_into", "graph_fake_mode"]


class LoweringError(RuntimeError):
    """A fused op could not replace the aten nodes it covers (a bug in a rule or in opfuse)."""


def graph_fake_mode(graph: fx.Graph):
    """The fake mode of ``graph``'s values (``node.meta['val']``)."""
    for node in graph.nodes:
        val = fake_value(node)
        if isinstance(val, torch.Tensor) and hasattr(val, "fake_mode"):
            return val.fake_mode
    raise LoweringError("opfuse: the aten graph carries no fake tensors (node.meta['val'])")


def _describe(val) -> str:
    if isinstance(val, torch.Tensor):
        return f"{str(val.dtype).replace('torch.', '')}{list(val.shape)}"
    return repr(val)


def _decompositions() -> dict:
    from torch._inductor.compile_fx import select_decomp_table

    return select_decomp_table()


def trace_into(graph: fx.Graph, fn, inputs: list[fx.Node], before: fx.Node, fake_mode, where: str):
    """Trace ``fn`` on the fake values of ``inputs`` and insert its aten nodes before ``before``
    (tagged ``opfuse_fused=where``); returns its outputs as nodes, in ``fn``'s structure."""
    # Traced with Inductor's decompositions: the graph around it went through them, and Inductor
    # refuses an op it has both a decomposition and a fallback for (``aten.t`` of an addmm).
    with torch.no_grad(), fake_mode:
        traced = make_fx(fn, decomposition_table=_decompositions())(*[fake_value(n) for n in inputs])
    env = dict(zip([n for n in traced.graph.nodes if n.op == "placeholder"], inputs))
    result = None
    with graph.inserting_before(before):
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                result = fx.node.map_arg(node.args[0], env.__getitem__)
                break
            copy = graph.node_copy(node, env.__getitem__)
            copy.meta["opfuse_fused"] = where
            env[node] = copy
    return result


class _Lowering:
    def __init__(self, op_graph: OpGraph, aten_gm: fx.GraphModule):
        self.op_graph = op_graph
        self.graph = aten_gm.graph
        self._fake_mode = None
        self.values: dict[str, fx.Node] = {}   # op-graph node name -> aten node now holding its value
        self.covered: set[fx.Node] = set()
        self.restrided: set[fx.Node] = set()  # replacements whose strides differ (view_layouts)

    @property
    def fake_mode(self):
        """The graph's fake mode, looked up when a fused op is first emitted: a graph with nothing
        to lower may carry no tensors at all (a dynamic-shape graph computing only sizes)."""
        if self._fake_mode is None:
            self._fake_mode = graph_fake_mode(self.graph)
        return self._fake_mode

    # Values ----------------------------------------------------------------------------------

    def value_of(self, node) -> fx.Node:
        """The aten node holding op-graph value ``node`` (emitting it for a value that exists only
        in the op graph)."""
        if not isinstance(node, fx.Node):
            return node
        if node.name in self.values:
            return self.values[node.name]
        aten = self.op_graph.aten.get(node.name)
        if aten is None:
            region = self.op_graph.regions.get(node.name)
            if region is None:
                raise LoweringError(f"opfuse: op-graph value {node.name} has no aten counterpart")
            aten = self.emit(self.op_graph.gm.get_submodule(node.target), [self.value_of(a) for a in node.args],
                             where=node.name)
        self.values[node.name] = aten
        return aten

    # Emitting ----------------------------------------------------------------------------------

    def emit(self, module, args: list, where: str, tokens_first: bool = False):
        """Trace ``module(*args)`` into the aten graph; returns its output node(s).

        ``tokens_first``: tensors of 3+ dims go in as ``[tokens, features]`` (fused ops treat every
        leading dim as tokens, their collectives gather and scatter along dim 0; what a model
        holds as ``[batch, seq, features]`` is the same memory)."""
        params = dict(module.named_parameters(remove_duplicate=False))
        names = list(params)
        sources = [param_source(self.op_graph, params[n]).node for n in names]
        tensor_args = [i for i, a in enumerate(args) if isinstance(a, fx.Node)]
        inputs = [args[i] for i in tensor_args] + sources

        def run(*tensors):
            call_args = list(args)
            for slot, tensor in zip(tensor_args, tensors):
                if tokens_first and tensor.dim() > 2:
                    tensor = tensor.reshape(-1, tensor.shape[-1])
                call_args[slot] = tensor
            bound = dict(zip(names, tensors[len(tensor_args):]))
            return torch.func.functional_call(module, bound, tuple(call_args))

        order = {n: i for i, n in enumerate(self.graph.nodes)}
        anchor = max(inputs, key=order.__getitem__)
        return trace_into(self.graph, run, inputs, anchor.next, self.fake_mode, where)

    def replace(self, op_name: str, new: fx.Node, rule: str, inputs=()) -> None:
        old = self.op_graph.aten.get(op_name)
        self.values[op_name] = new
        if old is None or old in inputs:
            return  # an exported input (h = x when nothing is added): its users keep reading it
        got, want = fake_value(new), fake_value(old)
        if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.dtype == want.dtype
                and known_equal(got.numel(), want.numel())):
            raise LoweringError(f"opfuse: rule {rule}: the fused op returns {_describe(got)} for {old.name}, which "
                                f"holds {_describe(want)}")
        if not same_shape(tuple(got.shape), tuple(want.shape)):  # [tokens, features] back to the model's shape
            sizes = self.size_args(want.shape, new)
            order = {n: i for i, n in enumerate(self.graph.nodes)}
            with self.graph.inserting_after(max([new, *[a for a in sizes if isinstance(a, fx.Node)]],
                                                key=order.__getitem__)):
                view = self.graph.call_function(torch.ops.aten.view.default, (new, sizes))
            with self.fake_mode:
                view.meta["val"] = got.view(want.shape)
            new = view
        if not same_layout(fake_value(new), want):
            self.restrided.add(new)
        old.replace_all_uses_with(new)

    def size_args(self, dims, before: fx.Node) -> list:
        """``dims`` as arguments of an aten call inserted after ``before``: ints as they are; a
        size that varies between calls (dynamic shapes) as the graph node that holds it (a
        ``Sym(s0)`` input, a ``sym_size`` or arithmetic on them), else ``-1`` when it is the only
        one, else a ``sym_size`` of a graph value of that size. A ``SymInt`` cannot be written
        into a graph as a constant."""
        varying = [d for d in dims if not is_static_size(d)]
        if not varying:
            return [int(size) for size in dims]
        holders = {}
        for node in self.graph.nodes:
            val = fake_value(node)
            if isinstance(val, torch.SymInt):
                holders.setdefault(val.node.expr, node)
        args = []
        for size in dims:
            if is_static_size(size):
                args.append(int(size))
                continue
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            holder = holders.get(expr)
            if holder is not None and self._before(holder, before):
                args.append(holder)
            elif len(varying) == 1:
                args.append(-1)
            else:
                args.append(self._sym_size(expr, before))
        return args

    def _before(self, a: fx.Node, b: fx.Node) -> bool:
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        return order[a] <= order[b]

    def _sym_size(self, expr, before: fx.Node) -> fx.Node:
        """A ``sym_size`` node of a value computed before ``before`` whose dim has size ``expr``."""
        for node in self.graph.nodes:
            if node is before:
                break
            val = fake_value(node)
            if isinstance(val, torch.Tensor):
                for dim, size in enumerate(val.shape):
                    if isinstance(size, torch.SymInt) and size.node.expr == expr:
                        with self.graph.inserting_after(before):
                            found = self.graph.call_function(torch.ops.aten.sym_size.int, (node, dim))
                        found.meta["val"] = size
                        return found
        raise LoweringError(f"opfuse: no value in the graph holds the size {expr} (dynamic shapes)")

    # Fusions ---------------------------------------------------------------------------------

    def lower_fused(self, node: fx.Node, module: FusedOp) -> None:
        rule = node.meta.get("opfuse_rule", module.name)
        inputs = [self.value_of(a) for a in node.args]
        out = self.emit(module, inputs, where=node.name, tokens_first=True)
        replaced = node.meta.get("opfuse_replaces")
        if replaced is not None:
            self.replace(replaced, out, rule, inputs)
        # Also a value that exists only in the op graph (a horizontal GEMM's packed gate | up, read
        # by the fused gated activation after it) has its aten node now.
        self.values[node.name] = out
        for user in list(node.users):
            if user.op == "call_function" and user.args[0] is node and "opfuse_replaces" in user.meta:
                self.replace(user.meta["opfuse_replaces"], out[user.args[1]], rule, inputs)
                self.values[user.name] = out[user.args[1]]
        for name, _kind in node.meta.get("opfuse_covered", ()):
            region = self.op_graph.regions.get(name)
            if region is not None:
                self.covered |= region.nodes
            elif self.op_graph.aten.get(name) is not None:  # a plain aten op a pass fused (a split, a cat)
                self.covered.add(self.op_graph.aten[name])

    def leave(self, node: fx.Node) -> None:
        """Leave fused node ``node`` unlowered (:mod:`.reference_fusions`): the aten nodes it covers
        stay, and what reads its values reads the aten values they stand for."""
        for value in fused_values(node):
            replaced = self.op_graph.aten.get(value.meta.get("opfuse_replaces"))
            if replaced is not None:
                self.values[value.name] = replaced

    def reemit_split(self) -> None:
        """The bias half of an ``addmm`` whose GEMM a fusion took computes ``GEMM + bias`` itself:
        emit it again on the fused op's output."""
        gm = self.op_graph.gm
        for node in gm.graph.nodes:
            region = self.op_graph.regions.get(node.name)
            if region is None or not region.virtual_input or node.op != "call_module":
                continue
            producer = node.args[0]
            if isinstance(producer, fx.Node) and producer.name in self.op_graph.regions:
                continue  # the GEMM half is not fused: the addmm stays as it is
            new = self.emit(gm.get_submodule(node.target), [self.value_of(producer)], where=node.name)
            self.replace(node.name, new, "split addmm")
            self.covered |= region.nodes

    def erase_covered(self) -> None:
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        for node in sorted(self.covered, key=order.__getitem__, reverse=True):
            if not node.users:
                self.graph.erase_node(node)
        alive = set(self.graph.nodes)
        left = [n for n in self.covered if n in alive
                and calls(n, c10d.all_reduce, c10d.all_gather_into_tensor, c10d.reduce_scatter_tensor)]
        if left:
            users = {n.name: sorted(u.name for u in n.users) for n in left}
            raise LoweringError(f"opfuse: fused collectives are still used after fusion: {users}")


def lower_fusions(op_graph: OpGraph, aten_gm: fx.GraphModule, lowering: "_Lowering | None" = None,
                  left=frozenset()) -> None:
    """Replace every fused op of ``op_graph`` (after the pass pipeline) in ``aten_gm``
    (``lowering``: a :class:`_Lowering` subclass instance for fused ops that need more, e.g. the
    FP8 ones of :mod:`.fp8_lower`), but those named in ``left``, whose aten nodes stay
    (:mod:`.reference_fusions`)."""
    from torch._inductor.pattern_matcher import stable_topological_sort

    lowering = lowering or _Lowering(op_graph, aten_gm)
    gm = op_graph.gm
    for node in list(gm.graph.nodes):
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if isinstance(module, FusedOp):
                if node.name in left:
                    lowering.leave(node)
                else:
                    lowering.lower_fused(node, module)
    lowering.reemit_split()
    stable_topological_sort(aten_gm.graph)
    lowering.erase_covered()
    if lowering.restrided:
        refresh_layouts(aten_gm.graph, lowering.fake_mode, lowering.restrided)
    aten_gm.graph.lint()
    aten_gm.recompile()
