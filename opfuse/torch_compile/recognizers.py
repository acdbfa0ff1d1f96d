"""The torch.compile front end's recognizers: collectives, linears, biases and residual adds, the
ops every tensor-parallel transformer graph has and several families' rules read, in the forms
Inductor's decompositions leave them (see :mod:`opfuse.machinery.region` for what a region is):

=================  ==========================================================================
op                 aten form
=================  ==========================================================================
``AllReduce``      ``wait_tensor(_c10d_functional.all_reduce(x, "sum", group))``
``AllGather``      ``wait_tensor(all_gather_into_tensor(x, n, group))`` (dim 0)
``ReduceScatter``  ``wait_tensor(reduce_scatter_tensor(x, "sum", n, group))`` (dim 0, or DTensor's
                   sequence dim when every dim before it has size 1)
``BasicLinear``    ``mm(x, permute(W, [1, 0]))`` with ``W`` a graph input (a parameter) or its
                   dtype cast (``torch.autocast``), with the views that flatten ``x``'s leading
                   dims and restore them
``Bias``           ``add(y, b)`` with ``b`` a graph input of shape ``[features]`` (or its cast);
                   ``addmm(b, x, W.T)`` is a ``BasicLinear`` followed by a ``Bias``
``AddExtraInput``  ``add(a, b)`` of two tensors of one shape and dtype (the residual add)
=================  ==========================================================================
"""

from __future__ import annotations

import operator

from torch import fx

from ..machinery.aten import (aten, c10d, calls, dtype, is_cast_to, is_static_size, is_tensor_node, known_equal,
                              same_shape, shape)
from ..machinery.recognizer import Found, Phase, Recognizer
from ..machinery.region import VIEWS, ParamSource, Region, frozen, is_input, is_vector_of, standin
from ..ops import group as groups
from ..ops.collectives import AllGather, AllReduce, ReduceScatter
from ..ops.extra import AddExtraInput
from ..ops.linear import BasicLinear, Bias

__all__ = ["collective", "linear", "add", "BASIC_RECOGNIZERS"]


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
    if len(parts) != len(split.users) or any(not known_equal(size, 1) for size in dims[:dim % len(dims)]):
        return x, set()
    return y, {x, split, *parts}


def collective(wait: fx.Node, found: Found | None = None) -> Region | None:
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
    return Region(frozen(cls(group=group)), (x,), wait, frozenset({issue, wait, *extra}))


# Linear ---------------------------------------------------------------------------------------------


def _view_chain(node) -> tuple[fx.Node, list[fx.Node]]:
    """``node``'s source through a chain of views (reshapes), and the views."""
    chain = []
    while calls(node, *VIEWS):
        chain.append(node)
        node = node.args[0]
    return node, chain


def _private_view_chain(mm: fx.Node, a: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """:func:`_view_chain` of GEMM ``mm``'s input ``a``, stopping at a view other GEMMs' inputs
    share (q, k and v flatten one all-gathered value through a shared view): each linear's region
    keeps only its own views, so that every one of them is recognised."""
    chain, node = [], a
    while calls(node, *VIEWS):
        if node is not a and len(node.users) > 1:
            break
        if node is a and any(u is not mm and _gemm_input(u) is a for u in a.users):
            break
        chain.append(node)
        node = node.args[0]
    return node, chain


def _gemm_input(node) -> fx.Node | None:
    """The activation operand of an ``mm`` / ``addmm`` whose other operand is a transposed weight."""
    if calls(node, aten.mm.default):
        x, b = node.args[:2]
    elif calls(node, aten.addmm.default):
        x, b = node.args[1:3]
    else:
        return None
    return x if calls(b, aten.permute.default) and is_input(b.args[0]) else None


def _same_rows(a, b) -> bool:
    """Two shapes hold the same ``[tokens, features]`` (every leading dim is tokens, as opfuse's ops
    see it), known without guards when token counts are symbolic."""
    return bool(a) and bool(b) and known_equal(_numel(a[:-1]), _numel(b[:-1])) and known_equal(a[-1], b[-1])


def _through_views(node) -> tuple[fx.Node, list[fx.Node]]:
    """``node`` seen through views that keep its rows: round trips that give the source's shape
    back (functionalised in-place collectives on reshaped tensors leave them) and regroupings of
    the leading dims (an MoE block all-reduces its ``[tokens, hidden]`` combine, then reshapes it to
    ``[batch, seq, hidden]`` for the residual add): ``(source, views)``, or ``(node, [])`` when
    the views change the features."""
    source, chain = _view_chain(node)
    if chain and is_tensor_node(source) and _same_rows(shape(source), shape(node)):
        return source, chain
    return node, []


def _numel(dims) -> int:
    count = 1
    for size in dims:
        count *= size
    return count


def linear(mm: fx.Node, found: Found | None = None) -> list[Region]:
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
    if not (is_static_size(k) and is_static_size(n)):
        return []  # a weight's sizes are fixed; only token counts vary between calls
    nodes = {mm}
    # The weight of ``mm(x, permute(W))`` is ``W``. Only weights that are graph inputs count
    # (parameters, or their local shards under DTensor), or such an input cast to the activations'
    # dtype (``torch.autocast`` over float32 parameters casts each weight in the graph; the cast
    # stays in the graph and the fused op reads its result): the GEMMs of backward graphs multiply
    # activations and transposed weights, which the fused ops do not take.
    if not (calls(b, aten.permute.default) and list(b.args[1]) == [1, 0] and is_weight(b.args[0])):
        return []
    weight = ParamSource(b.args[0])
    nodes.add(b)
    # x's leading dims flattened for the GEMM and restored on its result, through any views (the
    # grouping of the leading dims may differ: a dim-1 all-gather with batch 1 is viewed that way).
    x, out = a, mm
    source, views_in = _private_view_chain(mm, a)
    dims = shape(source)
    if views_in and dims is not None and known_equal(dims[-1], k) and known_equal(_numel(dims[:-1]), a_shape[0]):
        x = source
        nodes.update(views_in)
    # The result is the view that gives x's leading dims back; views after it are the model's own
    # (a projection whose width equals head_dim, Qwen2's k_proj / v_proj at one head per rank, is
    # viewed as [B, S, 1, head_dim] next: that view is not the linear's output). Without such a
    # view, the last one of width n (the leading dims regrouped).
    lead = shape(x)[:-1]
    cur, views_out = mm, []
    while len(cur.users) == 1 and calls(next(iter(cur.users)), *VIEWS):
        cur = next(iter(cur.users))
        views_out.append(cur)
        if known_equal(shape(cur)[-1], n):
            out = cur
            if same_shape(shape(cur)[:-1], lead):
                break
    out_views = views_out[:views_out.index(out) + 1] if out is not mm else []
    nodes.update(out_views)
    if dtype(x) != dtype(weight.node):
        return []
    weight_standin = standin((n, k), dtype(weight.node), weight.node)
    gemm = Region(frozen(BasicLinear(k, n, weight=weight_standin)), (x,), out, frozenset(nodes), {weight_standin: weight})
    if bias is None:
        return [gemm]
    if not is_vector_of(bias, n) or dtype(bias) != dtype(mm) or not is_weight(bias):
        return []
    # addmm: the GEMM has no value of its own; the bias region's nodes (the addmm and the views
    # that restore x's leading dims) compute from x and W.
    gemm.value, gemm.anchor = None, mm
    gemm.nodes = frozenset(nodes - {mm, *out_views})
    bias_standin = standin((n,), dtype(bias), bias)
    biased = Region(frozen(Bias(n, bias=bias_standin)), (), out, frozenset({mm, *out_views}),
                    {bias_standin: ParamSource(bias)}, virtual_input=True)
    return [gemm, biased]


def is_weight(node) -> bool:
    """A graph input, or a graph input cast to another dtype (``torch.autocast``'s weight cast)."""
    return is_input(node) or (is_cast_to(node) and is_input(node.args[0]))


# Adds -------------------------------------------------------------------------------------------------

#: Producers that make an operand the main input of a residual add (the chain the rules follow).
_CHAIN_KINDS = {"AllReduce": 3, "ReduceScatter": 3, "Bias": 2, "BasicLinear": 2}
#: Producers whose value is best reduced by a fused op (a row-parallel projection's partial sums).
_GEMM_KINDS = ("BasicLinear", "Bias")


def _feeds_only(source: fx.Node, views: list[fx.Node], node: fx.Node) -> bool:
    """``source`` reaches ``node`` through ``views`` and is used nowhere else (a value a fused op
    can keep inside: the rules refuse interior values that other nodes read)."""
    chain = [source, *reversed(views)]
    for value, user in zip(chain, [*chain[1:], node]):
        if set(value.users) != {user}:
            return False
    return True


def _main_input_rank(source: fx.Node, views: list[fx.Node], node: fx.Node, region_of) -> tuple:
    """How well operand ``source`` of the add ``node`` serves as its main input, the one the
    rules' chains (``AllReduce -> [Bias] -> AddExtraInput -> norm``) run through: first whether
    such a chain can fuse at all (a producer of a chain kind that nothing else reads), then the
    producer's kind, then for a collective whether it reduces a GEMM's partial sums. Two
    all-reduced operands (a vocabulary-sharded embedding's output and a row-parallel projection's,
    the first residual add of a Hugging Face model sharded with ``tp_plan="auto"``): the
    projection's, whose all-reduce the embedding's residual does not keep alive."""
    region = region_of(source)
    kind = region.kind if region is not None else None
    rank = _CHAIN_KINDS.get(kind, 0)
    reduces_gemm = False
    if kind in ("AllReduce", "ReduceScatter") and region.inputs:
        producer = region_of(_view_chain(region.inputs[0])[0]) or region_of(region.inputs[0])
        reduces_gemm = producer is not None and producer.kind in _GEMM_KINDS
    return (rank > 0 and _feeds_only(source, views, node), rank, reduces_gemm)


def add(node: fx.Node, found: Found) -> Region | None:
    """A residual add (``AddExtraInput``) or a bias add (``Bias``) at ``node``; ``found.region_of``
    maps a value to the region computing it (those found so far)."""
    if not calls(node, aten.add.Tensor) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if not (is_tensor_node(a) and is_tensor_node(b)) or shape(node) is None or len(shape(node)) < 1:
        return None
    if not is_static_size(shape(node)[-1]):
        return None  # feature sizes are fixed (only token counts may vary between calls)
    (a, views_a), (b, views_b) = _through_views(a), _through_views(b)
    for y, vec in ((a, b), (b, a)):
        if (_same_rows(shape(y), shape(node)) and is_vector_of(vec, shape(node)[-1]) and len(shape(node)) >= 2
                and len(shape(y)) >= 2 and is_weight(vec)):
            if dtype(node) != dtype(y) and dtype(vec) == dtype(y):
                return None
            bias_standin = standin((shape(node)[-1],), dtype(vec))
            return Region(frozen(Bias(shape(node)[-1], bias=bias_standin)), (y,), node,
                          frozenset({node, *views_a, *views_b}), {bias_standin: ParamSource(vec)})
    if not (_same_rows(shape(a), shape(node)) and _same_rows(shape(b), shape(node))) or not (
            dtype(a) == dtype(b) == dtype(node)):
        return None
    # The add is commutative: the main input is the operand whose chain the rules can fuse, the
    # other one is the residual. Ties keep the written order.
    if _main_input_rank(b, views_b, node, found.region_of) > _main_input_rank(a, views_a, node, found.region_of):
        a, b = b, a
    return Region(frozen(AddExtraInput()), (a, b), node, frozenset({node, *views_a, *views_b}))


#: The front end's own recognizers (the families add theirs: :mod:`.recognition`).
BASIC_RECOGNIZERS = (
    Recognizer("collective", Phase.COLLECTIVES, collective,
               "AllReduce, AllGather, ReduceScatter: a _c10d_functional collective and its wait_tensor"),
    Recognizer("linear", Phase.GEMMS, linear,
               "BasicLinear (+ Bias): mm / addmm of a transposed weight that is a graph input"),
    Recognizer("add", Phase.ADDS, add, "Bias (+ a 1-D parameter) and AddExtraInput (a residual add)"),
)
