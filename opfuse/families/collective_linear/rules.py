"""The collective-linear family's fusion rules: a GEMM with the all-gather before it or the
reduce-scatter after it (bias optional), and their FP8 variants.

===========================  ==========================================================  ====
rule                         pattern                                                     prio
===========================  ==========================================================  ====
all_gather_linear_fp8        [Quantize] -> AllGather -> BasicLinear(fp8) -> [Bias]       30
linear_reduce_scatter_fp8    [Quantize] -> BasicLinear(fp8) -> ReduceScatter -> [Bias]   30
all_gather_linear            AllGather -> BasicLinear -> [Bias]                          30
linear_reduce_scatter        BasicLinear -> ReduceScatter -> [Bias]                      30
linear_bias_reduce_scatter   BasicLinear -> Bias -> ReduceScatter                        30
gradient_all_gather          AllGather (of a gradient, nothing else fused it)            0
===========================  ==========================================================  ====

Each rule's replacement is the fused op of the same name, except ``linear_bias_reduce_scatter``
(``linear_reduce_scatter`` with the bias on every partial sum) and ``gradient_all_gather``
(``all_gather_tokens``: the backward's gather of a sequence-parallel output's gradient, whose GEMMs
are not recognised in a backward; forward gathers without a GEMM keep NCCL, whose kernel the FP8
weight casts run under). ``(fp8)``: GEMMs the FP8 pass
marked (under :func:`opfuse.fp8.autocast`); the bf16 rules refuse them (``not_fp8``).
"""

from __future__ import annotations

from ...machinery.pattern import OpSpec, Pattern
from ...machinery.predicates import (bias_matches_input, gathered_fp8_scale_shared, is_fp8, moves_a_gradient,
                                     not_fp8, not_quantized, quantize_fits_gather, quantize_fits_gemm)
from ...machinery.rule import Match, Replacement, Rule
from .fp8.op import AllGatherLinearFp8, LinearReduceScatterFp8
from .gather import AllGatherTokens
from .op import AllGatherLinear, LinearReduceScatter

__all__ = ["RULES"]


def build_all_gather_linear(match: Match) -> Replacement:
    bias = match.get("bias")
    module = AllGatherLinear(weight=match["linear"].op.weight, bias=bias.op.bias if bias else None,
                             group=match["gather"].op.group)
    return Replacement(module, [match.input("gather")])


def build_linear_reduce_scatter(match: Match) -> Replacement:
    bias = match.get("bias")
    module = LinearReduceScatter(weight=match["linear"].op.weight, bias=bias.op.bias if bias else None,
                                 group=match["scatter"].op.group, bias_after=True)
    return Replacement(module, [match.input("linear")])


def build_linear_bias_reduce_scatter(match: Match) -> Replacement:
    module = LinearReduceScatter(weight=match["linear"].op.weight, bias=match["bias"].op.bias,
                                 group=match["scatter"].op.group, bias_after=False)
    return Replacement(module, [match.input("linear")])


def build_all_gather_linear_fp8(match: Match) -> Replacement:
    linear, bias = match["linear"].op, match.get("bias")
    module = AllGatherLinearFp8(weight=linear.weight, bias=bias.op.bias if bias else None,
                                group=match["gather"].op.group, recipe=linear.recipe)
    return Replacement(module, [match.input("quantize" if "quantize" in match else "gather")])


def build_linear_reduce_scatter_fp8(match: Match) -> Replacement:
    linear, bias = match["linear"].op, match.get("bias")
    module = LinearReduceScatterFp8(weight=linear.weight, bias=bias.op.bias if bias else None,
                                    group=match["scatter"].op.group, recipe=linear.recipe)
    return Replacement(module, [match.input("quantize" if "quantize" in match else "linear")])


def build_gradient_all_gather(match: Match) -> Replacement:
    return Replacement(AllGatherTokens(group=match["gather"].op.group), [match.input("gather")])


RULES = (
    Rule("all_gather_linear_fp8",
         Pattern.chain(OpSpec("quantize", "Quantize", optional=True), OpSpec("gather", "AllGather"),
                       OpSpec("linear", "BasicLinear", where=[is_fp8]),
                       OpSpec("bias", "Bias", optional=True, where=[bias_matches_input])),
         build_all_gather_linear_fp8, priority=30, where=[quantize_fits_gather, gathered_fp8_scale_shared],
         description="token all-gather of FP8 bytes and scales overlapped with the FP8 column-parallel GEMM"),
    Rule("linear_reduce_scatter_fp8",
         Pattern.chain(OpSpec("quantize", "Quantize", optional=True), OpSpec("linear", "BasicLinear", where=[is_fp8]),
                       OpSpec("scatter", "ReduceScatter"),
                       OpSpec("bias", "Bias", optional=True, where=[bias_matches_input])),
         build_linear_reduce_scatter_fp8, priority=30, where=[quantize_fits_gemm],
         description="FP8 row-parallel GEMM, reduce-scatter of its partial sums in the activation dtype, bias after"),
    Rule("all_gather_linear",
         Pattern.chain(OpSpec("gather", "AllGather"), OpSpec("linear", "BasicLinear", where=[not_fp8]),
                       OpSpec("bias", "Bias", optional=True, where=[bias_matches_input])),
         build_all_gather_linear, priority=30,
         description="token all-gather overlapped with the column-parallel GEMM"),
    Rule("linear_reduce_scatter",
         Pattern.chain(OpSpec("linear", "BasicLinear", where=[not_fp8]), OpSpec("scatter", "ReduceScatter"),
                       OpSpec("bias", "Bias", optional=True, where=[bias_matches_input])),
         build_linear_reduce_scatter, priority=30,
         description="row-parallel GEMM overlapped with the token reduce-scatter; bias after the reduction"),
    Rule("linear_bias_reduce_scatter",
         Pattern.chain(OpSpec("linear", "BasicLinear", where=[not_fp8]), OpSpec("bias", "Bias", where=[bias_matches_input]),
                       OpSpec("scatter", "ReduceScatter")),
         build_linear_bias_reduce_scatter, priority=30,
         description="GEMM + per-rank bias overlapped with the token reduce-scatter"),
    Rule("gradient_all_gather",
         Pattern.chain(OpSpec("gather", "AllGather", where=[moves_a_gradient, not_quantized])),
         build_gradient_all_gather, priority=0,
         description="the backward's all-gather of a gradient on its own, over peer memory (copy engines, no SMs)"),
)
