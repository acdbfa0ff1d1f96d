"""The linear family's recognizer: GELU in aten graphs (what ``linear_bias_activation`` fuses with
the GEMM and bias before it), in its erf and tanh forms (:func:`opfuse.machinery.activations.gelu_form`).
"""

from __future__ import annotations

from torch import fx

from ...machinery.activations import gelu_form
from ...machinery.recognizer import Found, Phase, Recognizer
from ...machinery.region import Region, frozen
from ...ops.activation import GELU

__all__ = ["gelu", "RECOGNIZERS"]


def gelu(node: fx.Node, found: Found | None = None) -> Region | None:
    """``GELU`` anchored at ``node`` (its ``erf`` or ``tanh``)."""
    form = gelu_form(node)
    if form is None:
        return None
    approximate = "tanh" if form.activation == "gelu_tanh" else "none"
    return Region(frozen(GELU(approximate)), (form.x,), form.out, form.nodes)


RECOGNIZERS = (
    Recognizer("gelu", Phase.NORMS_AND_ACTIVATIONS, gelu, "GELU: F.gelu's erf and tanh forms"),
)
