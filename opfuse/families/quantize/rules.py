"""The quantize family's rule: an activation's quantization to FP8 that no larger fusion took
(``Quantize``, priority 1: the norms and GEMMs that quantize their own input go first)."""

from __future__ import annotations

from ...machinery.pattern import OpSpec, Pattern
from ...machinery.rule import Match, Replacement, Rule
from .op import QuantizeActivation

__all__ = ["RULES"]


def build_quantize(match: Match) -> Replacement:
    return Replacement(QuantizeActivation.from_op(match["quantize"].op), [match.input("quantize")])


RULES = (
    Rule("quantize", Pattern.chain(OpSpec("quantize", "Quantize")), build_quantize, priority=1,
         description="activation to FP8 (Triton amax + cast kernels)"),
)
