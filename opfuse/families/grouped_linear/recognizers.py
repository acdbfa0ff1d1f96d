"""The grouped-linear family's recognizer: ``BasicGroupedLinear`` in aten graphs, so that rules over
grouped GEMMs (``grouped_linear``, or a user's) fire under torch.compile too.

=======================  ==========================================================================
op                       aten form
=======================  ==========================================================================
``BasicGroupedLinear``   ``_grouped_mm(x, permute(W, [0, 2, 1]), offs)`` with ``x [T, K]``, ``W [G, N, K]``
                         a graph input (a parameter) and ``offs = cumsum(group_sizes, 0)`` computed in
                         the graph from the device group sizes; no bias, no ``out_dtype``
=======================  ==========================================================================

The op takes the group sizes (its extra input), so the offsets must be their cumulative sum in the
graph (a model that passes precomputed offsets is left alone). Rows past ``offs[-1]``, which
``torch._grouped_mm`` leaves unspecified, are zeros in the op. Backward graphs multiply by the
weight without the transpose (or by a transposed activation) and are not raised.
"""

from __future__ import annotations

from torch import fx

from ...machinery.aten import aten, calls, dtype, shape
from ...machinery.recognizer import Found, Phase, Recognizer
from ...machinery.region import ParamSource, Region, frozen, is_input, standin
from ...ops.grouped import BasicGroupedLinear

__all__ = ["grouped_mm", "RECOGNIZERS"]


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
    if not (calls(b, aten.permute.default) and list(b.args[1]) == [0, 2, 1] and is_input(b.args[0])):
        return None
    weight, sizes = b.args[0], _group_sizes(offs)
    x_shape, w_shape = shape(x), shape(weight)
    if sizes is None or x_shape is None or w_shape is None or len(x_shape) != 2 or len(w_shape) != 3:
        return None
    groups, n, k = w_shape
    if x_shape[1] != k or shape(sizes)[0] != groups or dtype(x) != dtype(weight):
        return None
    weight_standin = standin((groups, n, k), dtype(weight))
    op = BasicGroupedLinear(groups, k, n, weight=weight_standin)
    return Region(frozen(op), (x, sizes), node, frozenset({node, b, offs}), {weight_standin: ParamSource(weight)})


RECOGNIZERS = (
    Recognizer("grouped_mm", Phase.GEMMS, grouped_mm,
               "BasicGroupedLinear: torch._grouped_mm(x, W.transpose(-2, -1), offs=cumsum(group_sizes))"),
)
