"""The backward GEMMs of a recognised linear in AOTAutograd's joint graph.

A linear ``y = x @ W.T`` is ``mm(x2d, permute(W))`` in the forward half of the joint graph;
autograd wrote its gradients into the backward half as two more GEMMs::

    dgrad:  mm(dy, permute(permute(W)))   (or mm(dy, W))         -> dx [M, K]
    wgrad:  mm(permute(dy), x2d)          (or mm(permute(x2d), dy), transposed) -> dW [N, K]

(then views/permutes to the gradient the graph returns for ``W``). The FP8 lowering replaces both
with the FP8 backward GEMMs, reading the FP8 ``x`` the forward kept. :func:`linear_grads` finds
them: the weight gradient from the graph output AOTAutograd marks as ``W``'s gradient, the data
gradient among the GEMMs that read ``W``. Anything it cannot account for (a weight used by several
GEMMs, a gradient accumulated from several uses) makes it return a reason instead, and that linear
stays in high precision (a forward in FP8 with a backward that is not would follow no recipe).
"""

from __future__ import annotations

import dataclasses

from torch import fx

from ..machinery.aten import aten, calls, shape
from ..machinery.region import Region
from .inputs import input_key

__all__ = ["LinearGrads", "linear_grads", "gemm_of"]

_PASS_THROUGH = (aten.permute.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                 aten.alias.default, aten.clone.default, aten.t.default)


@dataclasses.dataclass
class LinearGrads:
    """The backward GEMMs of one linear: ``dy`` ``[M, N]``, ``dgrad`` (``mm -> [M, K]``) and
    ``wgrad`` (``mm -> [N, K]``, or ``[K, N]`` when ``wgrad_transposed``); ``None`` where autograd
    computes none (an input or a weight that needs no gradient)."""

    dy: fx.Node | None = None
    dgrad: fx.Node | None = None
    wgrad: fx.Node | None = None
    wgrad_transposed: bool = False

    @property
    def nodes(self) -> list[fx.Node]:
        return [n for n in (self.dgrad, self.wgrad) if n is not None]


def gemm_of(region: Region) -> fx.Node | None:
    """The ``mm`` / ``addmm`` of a ``BasicLinear`` region."""
    if region.anchor is not None and calls(region.anchor, aten.mm.default, aten.addmm.default):
        return region.anchor
    found = [n for n in region.nodes if calls(n, aten.mm.default, aten.addmm.default)]
    return found[0] if len(found) == 1 else None


def _is_transpose_of(node, source) -> bool:
    return calls(node, aten.permute.default) and node.args[0] is source and list(node.args[1]) == [1, 0]


def _strip(node) -> fx.Node:
    while calls(node, *_PASS_THROUGH):
        node = node.args[0]
    return node


def _same_value(a, b) -> bool:
    """``a`` and ``b`` are one value (the same node, or views of one node of equal shape)."""
    if a is b:
        return True
    return shape(a) == shape(b) and _strip(a) is _strip(b) and _strip(a) is not None


def _gemms_reading(weight: fx.Node) -> list[fx.Node]:
    """Every ``mm`` / ``addmm`` reading ``weight`` through permutes and views."""
    found, stack, seen = [], [weight], set()
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if calls(user, aten.mm.default, aten.addmm.default):
                found.append(user)
            elif calls(user, *_PASS_THROUGH):
                stack.append(user)
    return found


def linear_grads(region: Region, grad_outputs: dict, training: bool) -> LinearGrads | str:
    """The backward GEMMs of ``BasicLinear`` ``region`` (:class:`LinearGrads`), or a reason why
    they cannot be told apart. ``grad_outputs``: :func:`.inputs.output_keys` of the graph."""
    mm = gemm_of(region)
    if mm is None:
        return "its GEMM was not found"
    weight = next(iter(region.params.values())).node
    x2d = mm.args[1] if calls(mm, aten.addmm.default) else mm.args[0]
    m, k = shape(x2d)
    n = shape(mm)[1]
    if not training:
        return LinearGrads()
    others = [g for g in _gemms_reading(weight) if g is not mm]
    # dgrad: mm(dy, W^T^T) -> [M, K], reading the weight as its second operand.
    dgrads = [g for g in others if calls(g, aten.mm.default) and _strip(g.args[1]) is weight
              and shape(g) == (m, k) and shape(g.args[0]) == (m, n)]
    if len(others) != len(dgrads) or len(dgrads) > 1:
        return (f"its weight {weight.name} is read by {len(others) + 1} GEMMs (a weight shared by several "
                f"linears, or a backward this pass does not know)")
    grads = LinearGrads(dgrad=dgrads[0] if dgrads else None)
    if grads.dgrad is not None:
        grads.dy = grads.dgrad.args[0]
    key = input_key(weight.meta.get("desc"))
    grad = grad_outputs.get(("grad",) + key) if key is not None else None
    if grad is None:  # a frozen weight: no weight gradient
        return grads
    wgrad = _strip_to_gemm(grad)
    if wgrad is None:
        return f"the gradient of {weight.name} is not one GEMM (a weight used more than once?)"
    a, b = wgrad.args[:2]
    if _is_transpose_of(a, a.args[0]) and _same_value(b, x2d) and shape(wgrad) == (n, k):
        dy, transposed = a.args[0], False
    elif _is_transpose_of(a, a.args[0]) and _same_value(a.args[0], x2d) and shape(wgrad) == (k, n):
        dy, transposed = b, True
    else:
        return f"the GEMM computing the gradient of {weight.name} ({wgrad.name}) does not read the linear's input"
    if grads.dy is not None and not _same_value(dy, grads.dy):
        return f"its data and weight gradients ({grads.dgrad.name}, {wgrad.name}) read different output gradients"
    grads.dy = grads.dy if grads.dy is not None else dy
    grads.wgrad, grads.wgrad_transposed = wgrad, transposed
    return grads


def _strip_to_gemm(node) -> fx.Node | None:
    node = _strip(node)
    return node if calls(node, aten.mm.default) else None
