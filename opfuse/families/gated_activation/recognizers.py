"""The gated-activation family's recognizer: ``GatedActivation`` (``act(gate) * up``) in aten
graphs, so that rules over it (a user's, or a family's) fire under torch.compile too.

The activation is one of :mod:`opfuse.machinery.activations`' forms (SiLU: SwiGLU; GELU erf or
tanh: GeGLU), its result multiplied by a tensor ``up`` of the same shape and dtype. It runs in the
composite phase, before GELU alone is recognized, so that a GeGLU is claimed whole; except where
the gate comes from a GEMM whose bias is added to it, which the ``linear_bias_activation`` rule
fuses with its GELU (a larger fusion than any over the gated activation): that GELU is left to the
GELU recognizer.
"""

from __future__ import annotations

from torch import fx

from ...machinery.activations import gelu_form, silu_form
from ...machinery.aten import aten, calls, dtype, shape
from ...machinery.recognizer import Found, Phase, Recognizer
from ...machinery.region import VIEWS, Region, frozen, is_input, is_vector_of
from ...ops.activation import GatedActivation

__all__ = ["gated_activation", "RECOGNIZERS"]


def _biased_gemm(node: fx.Node) -> bool:
    """``node`` is a GEMM's output with a bias vector added (``addmm``, or ``mm`` then ``+ b``),
    through the views that restore leading dims."""
    while calls(node, *VIEWS):
        node = node.args[0]
    if calls(node, aten.addmm.default):
        return True
    if calls(node, aten.add.Tensor) and len(node.args) == 2:
        a, b = node.args
        for gemm, vec in ((a, b), (b, a)):
            while calls(gemm, *VIEWS):
                gemm = gemm.args[0]
            if calls(gemm, aten.mm.default) and is_input(vec) and is_vector_of(vec, (shape(node) or (0,))[-1]):
                return True
    return False


def gated_activation(node: fx.Node, found: Found | None = None) -> Region | None:
    """``GatedActivation`` anchored at its activation's anchor node (``erf``, ``tanh``, ``neg``,
    ``sigmoid``)."""
    form = gelu_form(node) or silu_form(node)
    if form is None or (form.activation != "silu" and _biased_gemm(form.x)):
        return None
    for gate_mul in form.out.users:
        if not calls(gate_mul, aten.mul.Tensor) or len(gate_mul.args) != 2 or gate_mul.kwargs:
            continue
        a, b = gate_mul.args
        up = b if a is form.out else a if b is form.out else None
        if up is None or up is form.out or not isinstance(up, fx.Node):
            continue
        if shape(up) != shape(form.x) or dtype(up) != dtype(form.x) or shape(gate_mul) != shape(form.x):
            continue
        if dtype(gate_mul) != dtype(form.x):
            continue
        return Region(frozen(GatedActivation(form.activation)), (form.x, up), gate_mul, form.nodes | {gate_mul})
    return None


RECOGNIZERS = (
    Recognizer("gated_activation", Phase.COMPOSITE, gated_activation,
               "GatedActivation: silu(gate) * up or gelu(gate) * up (SwiGLU, GeGLU)"),
)
