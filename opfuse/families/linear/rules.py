"""The linear family's fusion rules: a GEMM with its bias and GELU epilogue, and the FP8 GEMM with
its input's quantization and bias.

=======================  ================================================  ====
rule                     pattern                                           prio
=======================  ================================================  ====
fp8_linear               [Quantize] -> BasicLinear(fp8) -> [Bias]          16
linear_bias_activation   BasicLinear -> Bias -> GELU                       15
=======================  ================================================  ====
"""

from __future__ import annotations

from ...machinery.pattern import OpSpec, Pattern
from ...machinery.predicates import bias_matches_input, is_fp8, not_fp8, quantize_fits_gemm
from ...machinery.rule import Match, Replacement, Rule
from .fp8.op import Fp8Linear
from .op import LinearBiasActivation

__all__ = ["RULES"]


def build_linear_bias_activation(match: Match) -> Replacement:
    module = LinearBiasActivation(weight=match["linear"].op.weight, bias=match["bias"].op.bias,
                                  approximate=match["act"].op.approximate)
    return Replacement(module, [match.input("linear")])


def build_fp8_linear(match: Match) -> Replacement:
    linear, bias = match["linear"].op, match.get("bias")
    module = Fp8Linear(weight=linear.weight, bias=bias.op.bias if bias else None, recipe=linear.recipe)
    return Replacement(module, [match.input("quantize" if "quantize" in match else "linear")])


RULES = (
    Rule("linear_bias_activation",
         Pattern.chain(OpSpec("linear", "BasicLinear", where=[not_fp8]), OpSpec("bias", "Bias", where=[bias_matches_input]),
                       OpSpec("act", "GELU")),
         build_linear_bias_activation, priority=15, description="GEMM with bias + GELU epilogue"),
    Rule("fp8_linear",
         Pattern.chain(OpSpec("quantize", "Quantize", optional=True), OpSpec("linear", "BasicLinear", where=[is_fp8]),
                       OpSpec("bias", "Bias", optional=True, where=[bias_matches_input])),
         build_fp8_linear, priority=16, where=[quantize_fits_gemm],
         description="FP8 GEMM (torch._scaled_mm) with the input's quantization and the bias epilogue; FP8 "
                     "backward GEMMs"),
)
