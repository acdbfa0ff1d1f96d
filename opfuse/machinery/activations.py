"""The aten forms of activation functions after Inductor's decompositions, for recognizers that
need them (GELU alone, and the gated activations ``act(gate) * up`` that contain one):

========  ====================================================================================
form      aten nodes (``xf``: the input, upcast to float32 first for half-precision inputs)
========  ====================================================================================
GELU      ``0.5 * xf * (1 + erf(xf * sqrt(1/2)))`` (F.gelu) or
          ``0.5 * xf * (1 + tanh(sqrt(2/pi) * (xf + 0.044715 * xf^3)))`` (approximate="tanh")
SiLU      ``xf / (1 + exp(-xf))`` (F.silu as Inductor decomposes it) or ``xf * sigmoid(xf)``
========  ====================================================================================

then the cast back to the input's dtype when the input was upcast. Each ``*_form(node)`` is anchored
at one node of its form (``erf`` / ``tanh`` for GELU, ``neg`` / ``sigmoid`` for SiLU) and returns
an :class:`ActivationForm` or ``None``.
"""

from __future__ import annotations

import dataclasses

from torch import fx

from .aten import aten, before_upcast, calls, dtype, is_cast_to, scalar
from .region import other

__all__ = ["ActivationForm", "gelu_form", "silu_form"]

_SQRT_HALF = 0.7071067811865476
_SQRT_2_OVER_PI = 0.7978845608028654


@dataclasses.dataclass(frozen=True)
class ActivationForm:
    """An activation found in an aten graph: ``activation`` (``"gelu"``, ``"gelu_tanh"`` or
    ``"silu"``, the names of :data:`opfuse.ops.activation.ACTIVATIONS`), its input ``x``, the node
    holding its result ``out`` and every node of the form."""

    activation: str
    x: fx.Node
    out: fx.Node
    nodes: frozenset


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


def _cast_back(xf: fx.Node, out: fx.Node, nodes: set):
    """``(nodes, x, out)`` with the cast of ``out`` back to the dtype ``xf`` was upcast from, when
    it was; ``None`` when that cast is missing or ``out`` has other users."""
    x = before_upcast(xf)
    if x is not xf:
        cast = next((u for u in out.users if is_cast_to(u, dtype(x))), None)
        if cast is None or len(out.users) != 1:
            return None
        nodes |= {xf, cast}
        out = cast
    return nodes, x, out


def _gelu_tail(inner_fn: fx.Node, xf: fx.Node, nodes: set):
    """``0.5 * xf * (1 + inner_fn)``, then an optional cast back."""
    one = next(iter(inner_fn.users), None) if len(inner_fn.users) == 1 else None
    if one is None or not _plus_one(one) or len(one.users) != 1:
        return None
    out = next(iter(one.users))
    if not calls(out, aten.mul.Tensor):
        return None
    half = other(out, one)
    if half is None or _mul_by(half, 0.5, of=xf) is None:
        return None
    nodes |= {one, out, half}
    return _cast_back(xf, out, nodes)


def gelu_form(node: fx.Node) -> ActivationForm | None:
    """The GELU anchored at ``node`` (its ``erf`` or ``tanh``), if any."""
    if calls(node, aten.erf.default):
        xf = _mul_by(node.args[0], _SQRT_HALF)
        if xf is None:
            return None
        found = _gelu_tail(node, xf, {node.args[0], node})
        activation = "gelu"
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
        activation = "gelu_tanh"
    else:
        return None
    if found is None:
        return None
    nodes, x, out = found
    return ActivationForm(activation, x, out, frozenset(nodes))


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def silu_form(node: fx.Node) -> ActivationForm | None:
    """The SiLU anchored at ``node`` (the ``neg`` of ``xf / (1 + exp(-xf))``, or the ``sigmoid``
    of ``xf * sigmoid(xf)``), if any."""
    if calls(node, aten.neg.default):
        xf = node.args[0]
        exp = _only_user(node)
        one = _only_user(exp) if calls(exp, aten.exp.default) else None
        if one is None or not _plus_one(one) or one.args[0] is not exp:
            return None
        out = _only_user(one)
        if not calls(out, aten.div.Tensor) or out.args[0] is not xf or out.args[1] is not one:
            return None
        nodes = {node, exp, one, out}
    elif calls(node, aten.sigmoid.default):
        xf = node.args[0]
        out = next((u for u in node.users if calls(u, aten.mul.Tensor) and other(u, node) is xf), None)
        if out is None:
            return None
        nodes = {node, out}
    else:
        return None
    found = _cast_back(xf, out, nodes)
    if found is None:
        return None
    nodes, x, out = found
    return ActivationForm("silu", x, out, frozenset(nodes))
