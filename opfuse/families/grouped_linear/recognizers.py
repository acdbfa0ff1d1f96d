"""The grouped-linear family's recognizers: ``BasicGroupedLinear`` in aten graphs, so that rules over
grouped GEMMs (``grouped_linear``, ``grouped_linear_fp8``, or a user's) fire under torch.compile too.

=======================  ==========================================================================
op                       aten form
=======================  ==========================================================================
``BasicGroupedLinear``   ``_grouped_mm(x, permute(W, [0, 2, 1]), offs)`` with ``x [T, K]``, ``W [G, N, K]``
                         a graph input (a parameter) and ``offs = cumsum(group_sizes, 0)`` computed in
                         the graph from the device group sizes; no bias, no ``out_dtype``
``BasicGroupedLinear``   ``transformers::grouped_mm_fallback(x, permute(W, [0, 2, 1]), offs)``, the same
                         form: what transformers 5 calls instead of ``_grouped_mm`` for experts that are
                         not bfloat16 under torch.compile (a loop over host offsets, one sync per call);
                         16-bit weights only (float16 in practice): opfuse's grouped kernels are measured
                         on tensor cores, and against transformers' per-expert cuBLAS SGEMMs a float32
                         grouped GEMM on FMA units is not known to win, so float32 experts stay as they are
``BasicGroupedLinear``   ``opfuse::grouped_linear(x, group_sizes, weight, None, "", impl)``: what a
                         rewritten mixture-of-experts block calls (:mod:`opfuse.torch_compile.moe`),
                         its weight a graph input or a view of graph inputs (the stacked experts)
=======================  ==========================================================================

``_grouped_mm``: the op takes the group sizes (its extra input), so the offsets must be their
cumulative sum in the graph (a model that passes precomputed offsets is left alone); counts that
``torch.histc`` returns as floats are read as integers first (:mod:`opfuse.torch_compile.group_counts`). Rows past
``offs[-1]``, which ``torch._grouped_mm`` leaves unspecified, are zeros in the op. Backward graphs
multiply by the weight without the transpose (or by a transposed activation) and are not raised.

``opfuse::grouped_linear``: the pipeline then chooses its implementation for the graph's shapes
(and, with an FP8 recipe, makes it ``grouped_linear_fp8``). The backward the joint graph already
holds (``opfuse::grouped_linear_backward`` on the same ``x``, ``group_sizes`` and ``weight``) is
found by :func:`grouped_backward` for the lowering, which points it at the chosen implementation.
transformers' fallback op brings its own backward (``grouped_mm_fallback_backward``, the same host
loop); :func:`transformers_grouped_backward` finds it, and the lowering replaces it by
``opfuse::grouped_linear_backward`` on the chosen implementation.
"""

from __future__ import annotations

import torch
from torch import fx

from ...machinery.aten import aten, calls, dtype, is_tensor_node, shape
from ...machinery.recognizer import Found, Phase, Recognizer
from ...machinery.region import ParamSource, Region, frozen, is_input, standin
from ...ops.grouped import BasicGroupedLinear

__all__ = ["grouped_mm", "transformers_grouped_mm", "grouped_linear", "grouped_backward",
           "transformers_grouped_backward", "weight_source", "RECOGNIZERS"]


def _group_sizes(offs) -> fx.Node | None:
    """``sizes`` of ``offs = cumsum(sizes, 0)`` (a 1-D tensor of group sizes), else ``None``."""
    if not calls(offs, aten.cumsum.default) or len(offs.args) < 2 or offs.args[1] not in (0, -1):
        return None
    sizes = offs.args[0]
    dims = shape(sizes)
    return sizes if dims is not None and len(dims) == 1 else None


def grouped_mm(node: fx.Node, found: Found | None = None) -> Region | None:
    """``BasicGroupedLinear`` anchored at a ``_grouped_mm`` (see the module docstring)."""
    if not calls(node, aten._grouped_mm.default):
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    x, b, offs = args[0], args[1], node.kwargs.get("offs", args[2])
    if node.kwargs.get("bias") is not None or node.kwargs.get("out_dtype") is not None or len(node.args) > 3:
        return None
    return _offsets_region(node, x, b, offs)


def _transformers_op(name: str):
    """transformers' custom op ``transformers::<name>``, or ``None`` where transformers has not
    registered it (not installed, or a version without it)."""
    try:
        return getattr(torch.ops.transformers, name).default
    except (AttributeError, RuntimeError):
        return None


def transformers_grouped_mm(node: fx.Node, found: Found | None = None) -> Region | None:
    """``BasicGroupedLinear`` anchored at transformers' ``grouped_mm_fallback`` (module docstring):
    ``_grouped_mm``'s arguments and meaning, zeros past ``offs[-1]`` included."""
    op = _transformers_op("grouped_mm_fallback")
    if op is None or not calls(node, op) or len(node.args) != 3 or node.kwargs:
        return None
    if dtype(node.args[1]) not in (torch.float16, torch.bfloat16):
        return None
    return _offsets_region(node, *node.args)


def _transposed_input(node) -> fx.Node | None:
    """``W`` of ``permute(W, [0, 2, 1])`` with ``W`` a graph input, else ``None``."""
    if calls(node, aten.permute.default) and list(node.args[1]) == [0, 2, 1] and is_input(node.args[0]):
        return node.args[0]
    return None


def _offsets_region(node: fx.Node, x, b, offs) -> Region | None:
    """The region of a grouped GEMM ``x @ permute(W, [0, 2, 1])`` per group of ``offs``."""
    weight, sizes = _transposed_input(b), _group_sizes(offs)
    if weight is None:
        return None
    x_shape, w_shape = shape(x), shape(weight)
    if sizes is None or x_shape is None or w_shape is None or len(x_shape) != 2 or len(w_shape) != 3:
        return None
    groups, n, k = w_shape
    if x_shape[1] != k or shape(sizes)[0] != groups or dtype(x) != dtype(weight):
        return None
    weight_standin = standin((groups, n, k), dtype(weight))
    op = BasicGroupedLinear(groups, k, n, weight=weight_standin)
    # The offsets stay outside the region: an MoE block's grouped GEMMs (gate, up, down, and the
    # backward's) all read one cumsum, and a node claimed by one region would drop the others.
    return Region(frozen(op), (x, sizes), node, frozenset({node, b}), {weight_standin: ParamSource(weight)})


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.as_strided.default,
          aten.alias.default)


def _op(name: str):
    return getattr(torch.ops.opfuse, name).default


def weight_source(node) -> fx.Node | None:
    """The graph input ``node`` is a view of (``node`` itself when it is an input), else ``None``."""
    while calls(node, *_VIEWS):
        node = node.args[0]
    return node if isinstance(node, fx.Node) and node.op == "placeholder" else None


def grouped_linear(node: fx.Node, found: Found | None = None) -> Region | None:
    """``BasicGroupedLinear`` at a call of opfuse's own grouped op (see the module docstring)."""
    if not calls(node, _op("grouped_linear")):
        return None
    x, sizes, weight, bias, fsdp_group = node.args[:5]
    if bias is not None or fsdp_group or not all(is_tensor_node(n) for n in (x, sizes, weight)):
        return None
    if weight_source(weight) is None or len(shape(weight)) != 3 or len(shape(x)) != 2:
        return None
    groups, n, k = shape(weight)
    if shape(x)[1] != k or dtype(x) != dtype(weight):
        return None
    weight_standin = standin((groups, n, k), dtype(weight))
    op = frozen(BasicGroupedLinear(groups, k, n, weight=weight_standin))
    return Region(op, (x, sizes), node, frozenset({node}), {weight_standin: ParamSource(weight)})


def grouped_backward(forward: fx.Node) -> fx.Node | None:
    """The ``grouped_linear_backward`` call of the joint graph that differentiates ``forward``
    (same ``x``, ``group_sizes`` and ``weight``), if any."""
    x, sizes, weight = forward.args[:3]
    found = [u for u in x.users if calls(u, _op("grouped_linear_backward"))
             and u.args[1] is x and u.args[2] is sizes and u.args[3] is weight]
    return found[0] if len(found) == 1 else None


def transformers_grouped_backward(forward: fx.Node) -> fx.Node | None:
    """transformers' ``grouped_mm_fallback_backward(x, weight, offs, dy)`` of the joint graph that
    differentiates the ``grouped_mm_fallback`` call ``forward`` (the same ``x`` and offsets, the
    same weight transposed; the backward takes its own permute of it), if any. It returns
    ``(dx, dweight)``, ``dweight`` laid out as the op's weight argument."""
    op, fallback = _transformers_op("grouped_mm_fallback_backward"), _transformers_op("grouped_mm_fallback")
    if op is None or fallback is None or not calls(forward, fallback):
        return None
    x, b, offs = forward.args
    weight = _transposed_input(b)
    if weight is None:
        return None
    found = [u for u in x.users if calls(u, op) and len(u.args) == 4 and u.args[0] is x and u.args[2] is offs
             and _transposed_input(u.args[1]) is weight]
    return found[0] if len(found) == 1 else None


RECOGNIZERS = (
    Recognizer("grouped_mm", Phase.GEMMS, grouped_mm,
               "BasicGroupedLinear: torch._grouped_mm(x, W.transpose(-2, -1), offs=cumsum(group_sizes))"),
    Recognizer("transformers_grouped_mm", Phase.GEMMS, transformers_grouped_mm,
               "BasicGroupedLinear: transformers::grouped_mm_fallback(x, W.transpose(-2, -1), offs=cumsum(group_sizes)) "
               "(transformers' float16 experts under torch.compile)"),
    Recognizer("grouped_linear_op", Phase.GEMMS, grouped_linear,
               "BasicGroupedLinear: opfuse::grouped_linear (a rewritten mixture-of-experts block)"),
)
