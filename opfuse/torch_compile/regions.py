"""Recognising opfuse ops in aten graphs ("raising"): each :class:`Region` is a set of aten nodes
that computes what one basic op computes, with the op (an instance of the opfuse op class, its
parameters stand-ins on the meta device), its inputs and the node holding its result.

What is recognised, in the forms Inductor's decompositions leave them:

=================  ==========================================================================
op                 aten form
=================  ==========================================================================
``AllReduce``      ``wait_tensor(_c10d_functional.all_reduce(x, "sum", group))``
``AllGather``      ``wait_tensor(all_gather_into_tensor(x, n, group))`` (dim 0)
``ReduceScatter``  ``wait_tensor(reduce_scatter_tensor(x, "sum", n, group))`` (dim 0)
``BasicLinear``    ``mm(x, permute(W, [1, 0]))`` with ``W`` a graph input (a parameter), with the
                   views that flatten ``x``'s leading dims and restore them
``Bias``           ``add(y, b)`` with ``b`` a graph input of shape ``[features]``;
                   ``addmm(b, x, W.T)`` is a ``BasicLinear`` followed by a ``Bias``
``AddExtraInput``  ``add(a, b)`` of two tensors of one shape and dtype (the residual add)
``RMSNorm``        ``x.float() -> pow(2) (or x*x) -> mean(-1, keepdim) -> + eps -> rsqrt -> x*rstd``,
                   then ``* weight`` and the cast back in either order (F.rms_norm, nn.RMSNorm,
                   Llama-style hand-written norms); ``x.float()`` is absent for float32 inputs
``LayerNorm``      ``var_mean(x.float(), -1, correction=0) -> + eps -> rsqrt -> (x - mean) * rstd``,
                   ``* weight``, ``+ bias``, cast back (F.layer_norm, nn.LayerNorm)
``GELU``           the erf and tanh forms of F.gelu
=================  ==========================================================================

A region may hold interior values that other nodes use (the backward half of a joint graph reads
a norm's ``rsqrt``, a linear's flattened input): they are *recomputed* from the region's inputs
after fusion, so they must not involve a GEMM or a collective (such a region is not raised).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch import fx, nn

from ..ops import group as groups
from ..ops.activation import GELU
from ..ops.collectives import AllGather, AllReduce, ReduceScatter
from ..ops.extra import AddExtraInput
from ..ops.linear import BasicLinear, Bias
from ..ops.norm import LayerNorm, RMSNorm
from .aten import aten, c10d, calls, dtype, is_cast_to, is_tensor_node, scalar, shape

__all__ = ["ParamSource", "Region", "find_regions", "recompute_closure", "EXPENSIVE"]

#: Ops a region may not recompute (the work fusion saves, or a collective).
EXPENSIVE = (aten.mm, aten.addmm, aten.bmm, c10d.all_reduce, c10d.all_gather_into_tensor,
             c10d.reduce_scatter_tensor, c10d.wait_tensor)

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


@dataclasses.dataclass(frozen=True)
class ParamSource:
    """The graph input a stand-in parameter stands for."""

    node: fx.Node


@dataclasses.dataclass(eq=False)
class Region:
    """aten nodes standing for one opfuse op.

    ``inputs``: the main input, then the extra inputs (``AddExtraInput``'s residual).
    ``value``: the node holding the op's result; ``None`` for the GEMM half of an ``addmm``,
    whose result exists only with the bias added. ``virtual_input``: the region's nodes compute
    from its producer's inputs, not from its main input (the bias half of an ``addmm``).
    ``params``: each stand-in parameter of ``op`` and its source.
    """

    op: nn.Module
    inputs: tuple[fx.Node, ...]
    value: fx.Node | None
    nodes: frozenset[fx.Node]
    params: dict = dataclasses.field(default_factory=dict)
    virtual_input: bool = False
    #: Where the op sits in graph order when it has no value (the ``addmm``).
    anchor: fx.Node | None = None

    @property
    def position(self) -> fx.Node:
        return self.value if self.value is not None else self.anchor

    @property
    def kind(self) -> str:
        return self.op.kind


def _is_input(node) -> bool:
    """A value the graph receives (a parameter, a buffer, an input), not one it computes: the
    op graph shows parameters as attributes of ops, so a computed one would hide a dependency."""
    return isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr") and is_tensor_node(node)


def _standin(shape_, dtype_) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape_, device="meta", dtype=dtype_), requires_grad=False)


def _frozen(op: nn.Module) -> nn.Module:
    op.requires_grad_(False)  # stand-ins: gradients flow through the aten graph, never through them
    return op


def _is_vector_of(node, size) -> bool:
    dims = shape(node)
    return dims is not None and len(dims) == 1 and dims[0] == size


def _other(node: fx.Node, known) -> fx.Node | None:
    a, b = node.args[:2]
    if a is known:
        return b
    if b is known:
        return a
    return None


# Collectives ------------------------------------------------------------------------------------


def _split_along_tokens(x: fx.Node) -> tuple[fx.Node, set[fx.Node]]:
    """``cat([y.split(size, dim)[i] for i ...], dim=0)`` with every dim of ``y`` before ``dim`` of
    size 1 is ``y`` regrouped (DTensor's reduce-scatter along the sequence dim, batch 1): returns
    ``(y, nodes)``, else ``(x, set())``."""
    if not calls(x, aten.cat.default) or (len(x.args) > 1 and x.args[1] != 0):
        return x, set()
    parts = x.args[0]
    if not parts or not all(calls(p, operator.getitem) for p in parts):
        return x, set()
    split = parts[0].args[0]
    if not calls(split, aten.split.Tensor, aten.split_with_sizes.default) or len(split.args) < 3:
        return x, set()
    y, dim = split.args[0], split.args[2]
    dims = shape(y)
    if dims is None or any(p.args[0] is not split for p in parts) or [p.args[1] for p in parts] != list(range(len(parts))):
        return x, set()
    if len(parts) != len(split.users) or any(size != 1 for size in dims[:dim % len(dims)]):
        return x, set()
    return y, {x, split, *parts}


def _collective(wait: fx.Node) -> Region | None:
    if not calls(wait, c10d.wait_tensor.default) or not wait.args:
        return None
    issue = wait.args[0]
    if calls(issue, c10d.all_reduce.default):
        x, reduce_op, name = issue.args[:3]
        cls = AllReduce if reduce_op == "sum" else None
    elif calls(issue, c10d.all_gather_into_tensor.default):
        x, _size, name = issue.args[:3]
        cls = AllGather
    elif calls(issue, c10d.reduce_scatter_tensor.default):
        x, reduce_op, _size, name = issue.args[:4]
        cls = ReduceScatter if reduce_op == "sum" else None
    else:
        return None
    if cls is None or len(issue.users) != 1 or not is_tensor_node(x):
        return None
    try:
        group = groups.from_name(name)
    except Exception:  # noqa: BLE001 - a group this process does not know: leave the collective alone
        return None
    extra = set()
    if cls is ReduceScatter:
        x, extra = _split_along_tokens(x)
    return Region(_frozen(cls(group=group)), (x,), wait, frozenset({issue, wait, *extra}))


# Linear ---------------------------------------------------------------------------------------------


def _view_chain(node) -> tuple[fx.Node, list[fx.Node]]:
    """``node``'s source through a chain of views (reshapes), and the views."""
    chain = []
    while calls(node, *_VIEWS):
        chain.append(node)
        node = node.args[0]
    return node, chain


def _through_views(node) -> tuple[fx.Node, list[fx.Node]]:
    """``node`` seen through views that give its source's shape back (functionalised in-place
    collectives on reshaped tensors leave such round trips): ``(source, views)``, or
    ``(node, [])`` when the views change the shape."""
    source, chain = _view_chain(node)
    if chain and shape(source) == shape(node) and is_tensor_node(source):
        return source, chain
    return node, []


def _numel(dims) -> int:
    count = 1
    for size in dims:
        count *= size
    return count


def _linear(mm: fx.Node) -> list[Region]:
    if calls(mm, aten.mm.default):
        bias, a, b = None, mm.args[0], mm.args[1]
    elif calls(mm, aten.addmm.default):
        if mm.kwargs.get("beta", 1) != 1 or mm.kwargs.get("alpha", 1) != 1:
            return []
        bias, a, b = mm.args[:3]
    else:
        return []
    a_shape, b_shape = shape(a), shape(b)
    if a_shape is None or b_shape is None or len(a_shape) != 2 or len(b_shape) != 2:
        return []
    k, n = b_shape
    nodes = {mm}
    # The weight of ``mm(x, permute(W))`` is ``W``. Only weights that are graph inputs count
    # (parameters, or their local shards under DTensor): the GEMMs of backward graphs multiply
    # activations and transposed weights, which the fused ops do not take.
    if not (calls(b, aten.permute.default) and list(b.args[1]) == [1, 0] and _is_input(b.args[0])):
        return []
    weight = ParamSource(b.args[0])
    nodes.add(b)
    # x's leading dims flattened for the GEMM and restored on its result, through any views (the
    # grouping of the leading dims may differ: a dim-1 all-gather with batch 1 is viewed that way).
    x, out = a, mm
    source, views_in = _view_chain(a)
    dims = shape(source)
    if views_in and dims is not None and dims[-1] == k and _numel(dims[:-1]) == a_shape[0]:
        x = source
        nodes.update(views_in)
    cur, views_out = mm, []
    while len(cur.users) == 1 and calls(next(iter(cur.users)), *_VIEWS):
        cur = next(iter(cur.users))
        views_out.append(cur)
        if shape(cur)[-1] == n:
            out = cur
    if out is not mm:
        nodes.update(views_out[:views_out.index(out) + 1])
    if dtype(x) != dtype(weight.node):
        return []
    standin = _standin((n, k), dtype(weight.node))
    linear = Region(_frozen(BasicLinear(k, n, weight=standin)), (x,), out, frozenset(nodes), {standin: weight})
    if bias is None:
        return [linear]
    if not _is_vector_of(bias, n) or dtype(bias) != dtype(mm) or not _is_input(bias):
        return []
    # addmm: the GEMM has no value of its own; the bias region's nodes compute from x and W.
    linear.value, linear.anchor = None, mm
    linear.nodes = frozenset(nodes - {mm, out})
    bias_standin = _standin((n,), dtype(bias))
    add = Region(_frozen(Bias(n, bias=bias_standin)), (), out, frozenset({mm, out}), {bias_standin: ParamSource(bias)},
                 virtual_input=True)
    return [linear, add]


# Norms ----------------------------------------------------------------------------------------------


def _norm_input(xf: fx.Node) -> fx.Node:
    """The tensor a norm normalises: ``x`` of ``x.float()`` for half-precision inputs."""
    if is_cast_to(xf, torch.float32) and dtype(xf.args[0]) in (torch.bfloat16, torch.float16):
        return xf.args[0]
    return xf


def _is_last_dim(dims, ndim: int, keepdim) -> bool:
    return keepdim is True and list(dims) in ([-1], [ndim - 1])


def _affine_tail(start: fx.Node, x: fx.Node, hidden: int, with_bias: bool):
    """Follow ``start`` through ``* weight``, ``+ bias`` (LayerNorm) and the cast back to ``x``'s
    dtype, in any order Inductor's decompositions or hand-written norms produce. Returns
    ``(last node, nodes, weight, bias)``."""
    cur, nodes, weight, bias = start, [], None, None
    while True:
        step = None
        for user in cur.users:
            if is_cast_to(user) and user.args[0] is cur and dtype(user) == dtype(x) and dtype(cur) != dtype(x):
                step = ("cast", user, None)
            elif calls(user, aten.mul.Tensor) and weight is None and bias is None:
                other = _other(user, cur)
                if other is not None and _is_vector_of(other, hidden) and _is_input(other):
                    step = ("weight", user, other)
            elif calls(user, aten.add.Tensor) and with_bias and bias is None and len(user.args) == 2:
                other = _other(user, cur)
                if other is not None and _is_vector_of(other, hidden) and _is_input(other) and not user.kwargs:
                    step = ("bias", user, other)
            if step is not None:
                break
        if step is None:
            return cur, nodes, weight, bias
        kind, cur, operand = step
        nodes.append(cur)
        if kind == "weight":
            weight = operand
        elif kind == "bias":
            bias = operand


def _norm_region(cls, x, xf, normed, out, nodes, weight, bias, eps) -> Region | None:
    hidden = shape(x)[-1]
    if shape(out) != shape(x):
        return None
    param_dtype = dtype(weight) if weight is not None else dtype(x)
    if bias is not None and weight is not None and dtype(bias) != dtype(weight):
        return None
    # The fused op returns x's dtype. A different result dtype is only acceptable when a
    # parameter of another dtype caused it: the rules' norm_params_match_input refuses those
    # (and says so in explain()).
    if dtype(out) != dtype(x) and param_dtype == dtype(x):
        return None
    if cls is RMSNorm:
        op = RMSNorm(hidden, eps=eps, elementwise_affine=weight is not None, device="meta", dtype=param_dtype)
    else:
        if bias is not None and weight is None:
            return None
        op = LayerNorm(hidden, eps=eps, elementwise_affine=weight is not None, bias=bias is not None, device="meta",
                       dtype=param_dtype)
    params = {}
    if weight is not None:
        params[op.weight] = ParamSource(weight)
    if bias is not None:
        params[op.bias] = ParamSource(bias)
    if xf is not x:
        nodes.add(xf)
    return Region(_frozen(op), (x,), out, frozenset(nodes), params)


def _rms_norm(rsqrt: fx.Node) -> Region | None:
    if not calls(rsqrt, aten.rsqrt.default):
        return None
    add = rsqrt.args[0]
    if not calls(add, aten.add.Tensor, aten.add.Scalar) or scalar(add.args[1]) is None:
        return None
    mean = add.args[0]
    if not calls(mean, aten.mean.dim) or len(mean.args) < 3:
        return None
    square = mean.args[0]
    if calls(square, aten.pow.Tensor_Scalar) and scalar(square.args[1]) == 2.0:
        xf = square.args[0]
    elif calls(square, aten.mul.Tensor) and square.args[0] is square.args[1]:
        xf = square.args[0]
    else:
        return None
    if shape(xf) is None or not _is_last_dim(mean.args[1], len(shape(xf)), mean.args[2]):
        return None
    normed = next((u for u in rsqrt.users if calls(u, aten.mul.Tensor) and _other(u, rsqrt) is xf), None)
    if normed is None:
        return None
    x = _norm_input(xf)
    out, tail, weight, _ = _affine_tail(normed, x, shape(x)[-1], with_bias=False)
    nodes = {square, mean, add, rsqrt, normed, *tail}
    return _norm_region(RMSNorm, x, xf, normed, out, nodes, weight, None, scalar(add.args[1]))


def _layer_norm(var_mean: fx.Node) -> Region | None:
    if not calls(var_mean, aten.var_mean.correction) or var_mean.kwargs.get("correction", 1) != 0:
        return None
    if var_mean.kwargs.get("keepdim") is not True or len(var_mean.args) < 2:
        return None
    xf = var_mean.args[0]
    if shape(xf) is None or list(var_mean.args[1]) not in ([-1], [len(shape(xf)) - 1]):
        return None
    items = {u.args[1]: u for u in var_mean.users if u.op == "call_function" and len(u.args) == 2}
    var, mean = items.get(0), items.get(1)
    if var is None or mean is None:
        return None
    add = next((u for u in var.users if calls(u, aten.add.Tensor, aten.add.Scalar) and scalar(u.args[1]) is not None),
               None)
    rsqrt = next(iter(add.users), None) if add is not None and len(add.users) == 1 else None
    if not calls(rsqrt, aten.rsqrt.default):
        return None
    centered = next((u for u in mean.users if calls(u, aten.sub.Tensor) and u.args[0] is xf and u.args[1] is mean),
                    None)
    if centered is None:
        return None
    normed = next((u for u in centered.users if calls(u, aten.mul.Tensor) and _other(u, centered) is rsqrt), None)
    if normed is None:
        return None
    x = _norm_input(xf)
    out, tail, weight, bias = _affine_tail(normed, x, shape(x)[-1], with_bias=True)
    nodes = {var_mean, var, mean, add, rsqrt, centered, normed, *tail}
    return _norm_region(LayerNorm, x, xf, normed, out, nodes, weight, bias, scalar(add.args[1]))


# GELU -----------------------------------------------------------------------------------------------

_SQRT_HALF = 0.7071067811865476
_SQRT_2_OVER_PI = 0.7978845608028654


def _mul_by(node, factor, of=None) -> fx.Node | None:
    """``node`` is ``of * factor`` (either order); returns ``of`` (or the tensor operand)."""
    if not calls(node, aten.mul.Tensor) or len(node.args) != 2:
        return None
    a, b = node.args
    if scalar(b) is not None and abs(scalar(b) - factor) < 1e-12 and (of is None or a is of):
        return a
    if scalar(a) is not None and abs(scalar(a) - factor) < 1e-12 and (of is None or b is of):
        return b
    return None


def _plus_one(node) -> bool:
    return calls(node, aten.add.Tensor, aten.add.Scalar) and len(node.args) == 2 and scalar(node.args[1]) == 1.0


def _gelu_tail(inner_fn: fx.Node, xf: fx.Node, nodes: set) -> Region | None:
    """``0.5 * xf * (1 + inner_fn)``, then an optional cast back."""
    one = next(iter(inner_fn.users), None) if len(inner_fn.users) == 1 else None
    if one is None or not _plus_one(one) or len(one.users) != 1:
        return None
    out = next(iter(one.users))
    if not calls(out, aten.mul.Tensor):
        return None
    half = _other(out, one)
    if half is None or _mul_by(half, 0.5, of=xf) is None:
        return None
    nodes |= {one, out, half}
    x = _norm_input(xf)
    if x is not xf:
        cast = next((u for u in out.users if is_cast_to(u, dtype(x))), None)
        if cast is None or len(out.users) != 1:
            return None
        nodes |= {xf, cast}
        out = cast
    return nodes, x, out


def _gelu(node: fx.Node) -> Region | None:
    if calls(node, aten.erf.default):
        xf = _mul_by(node.args[0], _SQRT_HALF)
        if xf is None:
            return None
        found = _gelu_tail(node, xf, {node.args[0], node})
        approximate = "none"
    elif calls(node, aten.tanh.default):
        # tanh(sqrt(2/pi) * (x + 0.044715 * x^3)), x^3 as (x * x) * x
        inner = _mul_by(node.args[0], _SQRT_2_OVER_PI)
        if not calls(inner, aten.add.Tensor) or len(inner.args) != 2:
            return None
        xf, cubic = inner.args
        cube = _mul_by(cubic, 0.044715)
        if cube is None or not calls(cube, aten.mul.Tensor) or cube.args[1] is not xf:
            return None
        square = cube.args[0]
        if not calls(square, aten.mul.Tensor) or square.args[0] is not xf or square.args[1] is not xf:
            return None
        found = _gelu_tail(node, xf, {node.args[0], inner, cubic, cube, square, node})
        approximate = "tanh"
    else:
        return None
    if found is None:
        return None
    nodes, x, out = found
    return Region(_frozen(GELU(approximate)), (x,), out, frozenset(nodes))


# Adds -------------------------------------------------------------------------------------------------

#: Producers that make an operand the main input of a residual add (the chain the rules follow).
_CHAIN_KINDS = {"AllReduce": 3, "ReduceScatter": 3, "Bias": 2, "BasicLinear": 2}


def _add(node: fx.Node, kind_of) -> Region | None:
    if not calls(node, aten.add.Tensor) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if not (is_tensor_node(a) and is_tensor_node(b)) or shape(node) is None:
        return None
    (a, views_a), (b, views_b) = _through_views(a), _through_views(b)
    for y, vec in ((a, b), (b, a)):
        if (shape(y) == shape(node) and _is_vector_of(vec, shape(node)[-1]) and len(shape(node)) >= 2
                and _is_input(vec)):
            if dtype(node) != dtype(y) and dtype(vec) == dtype(y):
                return None
            standin = _standin((shape(node)[-1],), dtype(vec))
            return Region(_frozen(Bias(shape(node)[-1], bias=standin)), (y,), node,
                          frozenset({node, *views_a, *views_b}), {standin: ParamSource(vec)})
    if shape(a) != shape(node) or shape(b) != shape(node) or not (dtype(a) == dtype(b) == dtype(node)):
        return None
    # The main input is the one the rules' chains come from (an all-reduce, a bias, a GEMM); the
    # other one is the residual. Ties keep the written order.
    if _CHAIN_KINDS.get(kind_of(b), 0) > _CHAIN_KINDS.get(kind_of(a), 0):
        a, b = b, a
    return Region(_frozen(AddExtraInput()), (a, b), node, frozenset({node, *views_a, *views_b}))


# The search -------------------------------------------------------------------------------------------


def recompute_closure(region: Region) -> set[fx.Node] | None:
    """Interior nodes of ``region`` that nodes outside it use, with the interior nodes they
    depend on (what stays in the graph after fusion, recomputed from the region's inputs);
    ``None`` when that would recompute a GEMM or a collective."""
    escaping = [n for n in region.nodes if n is not region.value and any(u not in region.nodes for u in n.users)]
    closure: set[fx.Node] = set()
    stack = list(escaping)
    while stack:
        node = stack.pop()
        if node in closure:
            continue
        if calls(node, *EXPENSIVE):
            return None
        closure.add(node)
        stack.extend(a for a in node.all_input_nodes if a in region.nodes)
    return closure


def find_regions(graph: fx.Graph) -> list[Region]:
    """Every region of ``graph``, in graph order of their results; each aten node belongs to at
    most one region (the ``addmm`` pair shares its node)."""
    taken: set[fx.Node] = set()
    found: list[Region] = []

    def claim(region: Region | None) -> None:
        if region is None or region.nodes & taken:
            return
        if region.value is not None and recompute_closure(region) is None:
            return
        taken.update(region.nodes)
        found.append(region)

    nodes = list(graph.nodes)
    for node in nodes:  # norms and activations first: they own muls and adds the others would take
        claim(_rms_norm(node) or _layer_norm(node) or _gelu(node))
    for node in nodes:
        claim(_collective(node))
    for node in nodes:
        pair = _linear(node)
        if pair and not any(r.nodes & taken for r in pair) and all(recompute_closure(r) is not None for r in pair):
            for region in pair:
                taken.update(region.nodes)
                found.append(region)
    kinds = {r.value: r.kind for r in found if r.value is not None}
    for node in nodes:
        claim(_add(node, lambda n: kinds.get(n)))
    order = {node: i for i, node in enumerate(nodes)}
    return sorted(found, key=lambda r: (order[r.position], r.virtual_input))
