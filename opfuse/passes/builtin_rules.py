"""The built-in fusion rules, as one readable list (:data:`BUILTIN_RULES`).

Priorities: larger fusions and those that hide communication go first.

==============================  ==================================================================  ====
rule                            pattern                                                             prio
==============================  ==================================================================  ====
allreduce_add_rmsnorm_quantize  AllReduce -> ... -> RMSNorm -> Quantize (as allreduce_add_rmsnorm)  45
allreduce_add_rmsnorm           AllReduce -> [Bias] -> [AddExtraInput] -> [MakeExtraOutput] -> RMSNorm   40
allreduce_add_layernorm         same, LayerNorm                                                       40
add_rmsnorm_quantize            [Bias] -> [AddExtraInput] -> [MakeExtraOutput] -> RMSNorm -> Quantize  35
add_layernorm_quantize          same, LayerNorm                                                       35
all_gather_linear_fp8           [Quantize] -> AllGather -> BasicLinear(fp8) -> [Bias]                 30
linear_reduce_scatter_fp8       [Quantize] -> BasicLinear(fp8) -> ReduceScatter -> [Bias]             30
all_gather_linear               AllGather -> BasicLinear -> [Bias]                                    30
linear_reduce_scatter           BasicLinear -> ReduceScatter -> [Bias]                                30
linear_bias_reduce_scatter      BasicLinear -> Bias -> ReduceScatter                                  30
add_rmsnorm                     [Bias] -> [AddExtraInput] -> [MakeExtraOutput] -> RMSNorm             20
add_layernorm                   same, LayerNorm                                                       20
fp8_linear                      [Quantize] -> BasicLinear(fp8) -> [Bias]                              16
linear_bias_activation          BasicLinear -> Bias -> GELU                                           15
allreduce                       AllReduce -> [Bias] -> [AddExtraInput]                                10
grouped_linear_fp8              BasicGroupedLinear(fp8)                                                5
grouped_linear                  BasicGroupedLinear                                                     5
quantize                        Quantize                                                               1
==============================  ==================================================================  ====

Each rule's replacement is the fused op of the same name, except ``linear_bias_reduce_scatter``
(``linear_reduce_scatter`` with the bias on every partial sum). ``grouped_linear`` merges nothing:
it moves the grouped GEMM onto the implementation table. ``(fp8)``: GEMMs the FP8 pass marked
(under :func:`opfuse.fp8.autocast`); the bf16 GEMM rules refuse them (``not_fp8``). The norms that
emit FP8 outrank the FP8 all-gather so that, in a sequence-parallel block, the norm quantizes and
the all-gather moves its bytes; the all-reduce + norm that emits FP8 outranks the one that does not.
"""

from __future__ import annotations

import torch

from ..families.collective_linear.fp8.op import AllGatherLinearFp8, LinearReduceScatterFp8
from ..families.collective_linear.op import AllGatherLinear, LinearReduceScatter
from ..families.grouped_linear.fp8.op import GroupedGemmFp8
from ..families.linear.fp8.op import Fp8Linear
from ..families.grouped_linear.op import GroupedGemm
from ..families.linear.op import LinearBiasActivation
from ..families.quantize.op import QuantizeActivation
from ..families.residual_norm.op import (AddLayerNorm, AddLayerNormQuantize, AddRMSNorm, AddRMSNormQuantize,
                                         AllReduceAddLayerNorm, AllReduceAddRMSNorm, AllReduceAddRMSNormQuantize,
                                         FusedAllReduce)
from ..machinery.pattern import OpSpec, Pattern
from ..machinery.predicates import (bias_matches_input, gathered_fp8_scale_shared, is_fp8, norm_params_match_input,
                                    not_fp8, one_group, quantize_fits_gather, quantize_fits_gemm)
from ..machinery.rule import Match, Replacement, Rule

__all__ = ["BUILTIN_RULES"]


# Builders -------------------------------------------------------------------------------------


def _residual_norm_parts(match: Match):
    """Constructor keywords, arguments and outputs of a residual-norm fused op for ``match``."""
    reduce, bias, add = match.get("allreduce"), match.get("bias"), match.get("add")
    extra, norm = match.get("extra"), match.get("norm")
    kwargs = {"bias": bias.op.bias if bias else None}
    if reduce is not None:
        kwargs["group"] = reduce.op.group
    if norm is not None:
        kwargs.update(weight=norm.op.weight, norm_bias=getattr(norm.op, "bias", None), eps=norm.op.eps,
                      has_residual=add is not None, export_residual=extra is not None)
    elif add is not None:
        kwargs["has_residual"] = True
    first = match.ordered()[0].name
    args = [match.input(first)] + ([match.input("add", 1)] if add is not None else [])
    outputs = {"norm": 0} if norm is not None else {match.ordered()[-1].name: 0}
    if extra is not None:
        outputs["extra"] = 1
    return kwargs, args, outputs


def _residual_norm_builder(cls):
    def build(match: Match) -> Replacement:
        kwargs, args, outputs = _residual_norm_parts(match)
        return Replacement(cls(**kwargs), args, outputs)

    build.__name__ = f"build_{cls.__name__}"
    return build


def _norm_quantize_builder(cls):
    def build(match: Match) -> Replacement:
        kwargs, args, outputs = _residual_norm_parts(match)
        q = match["quantize"].op
        module = cls(dtype="e4m3" if q.dtype == torch.float8_e4m3fn else "e5m2", rowwise=q.rowwise,
                     amax_group=q.amax_group, **kwargs)
        outputs["quantize"] = outputs.pop("norm")
        return Replacement(module, args, outputs)

    build.__name__ = f"build_{cls.__name__}"
    return build


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


def build_grouped_linear(match: Match) -> Replacement:
    module = GroupedGemm.from_op(match["gemm"].op)
    return Replacement(module, [match.input("gemm", 0), match.input("gemm", 1)])


def build_linear_bias_activation(match: Match) -> Replacement:
    module = LinearBiasActivation(weight=match["linear"].op.weight, bias=match["bias"].op.bias,
                                  approximate=match["act"].op.approximate)
    return Replacement(module, [match.input("linear")])


def build_fp8_linear(match: Match) -> Replacement:
    linear, bias = match["linear"].op, match.get("bias")
    module = Fp8Linear(weight=linear.weight, bias=bias.op.bias if bias else None, recipe=linear.recipe)
    return Replacement(module, [match.input("quantize" if "quantize" in match else "linear")])


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


def build_grouped_linear_fp8(match: Match) -> Replacement:
    return Replacement(GroupedGemmFp8.from_op(match["gemm"].op), [match.input("gemm", 0), match.input("gemm", 1)])


def build_quantize(match: Match) -> Replacement:
    return Replacement(QuantizeActivation.from_op(match["quantize"].op), [match.input("quantize")])


# Patterns -------------------------------------------------------------------------------------


def _norm_chain(norm_kind: str, reduce: bool, quantize: bool = False) -> Pattern:
    specs = []
    if reduce:
        specs.append(OpSpec("allreduce", "AllReduce"))
    specs += [
        OpSpec("bias", "Bias", optional=True, where=[bias_matches_input]),
        OpSpec("add", "AddExtraInput", optional=True),
        OpSpec("extra", "MakeExtraOutput", optional=True, exported=True),
        OpSpec("norm", norm_kind, where=[norm_params_match_input]),
    ]
    if quantize:
        specs.append(OpSpec("quantize", "Quantize"))
    return Pattern.chain(*specs)


BUILTIN_RULES = [
    Rule("allreduce_add_rmsnorm_quantize", _norm_chain("RMSNorm", reduce=True, quantize=True),
         _norm_quantize_builder(AllReduceAddRMSNormQuantize), priority=45, where=[one_group],
         description="all-reduce + bias + residual add + RMSNorm emitting FP8 in one peer-memory kernel"),
    Rule("allreduce_add_rmsnorm", _norm_chain("RMSNorm", reduce=True), _residual_norm_builder(AllReduceAddRMSNorm),
         priority=40, where=[one_group],
         description="all-reduce + bias + residual add + RMSNorm in one peer-memory kernel"),
    Rule("allreduce_add_layernorm", _norm_chain("LayerNorm", reduce=True),
         _residual_norm_builder(AllReduceAddLayerNorm), priority=40, where=[one_group],
         description="all-reduce + bias + residual add + LayerNorm"),
    Rule("add_rmsnorm_quantize", _norm_chain("RMSNorm", reduce=False, quantize=True),
         _norm_quantize_builder(AddRMSNormQuantize), priority=35,
         description="(bias +) (residual add +) RMSNorm emitting FP8 (the quantization of the next GEMM's input)"),
    Rule("add_layernorm_quantize", _norm_chain("LayerNorm", reduce=False, quantize=True),
         _norm_quantize_builder(AddLayerNormQuantize), priority=35,
         description="(bias +) (residual add +) LayerNorm emitting FP8"),
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
    Rule("add_rmsnorm", _norm_chain("RMSNorm", reduce=False), _residual_norm_builder(AddRMSNorm), priority=20,
         description="(bias +) (residual add +) RMSNorm in one pass"),
    Rule("add_layernorm", _norm_chain("LayerNorm", reduce=False), _residual_norm_builder(AddLayerNorm),
         priority=20, description="(bias +) (residual add +) LayerNorm in one pass"),
    Rule("linear_bias_activation",
         Pattern.chain(OpSpec("linear", "BasicLinear", where=[not_fp8]), OpSpec("bias", "Bias", where=[bias_matches_input]),
                       OpSpec("act", "GELU")),
         build_linear_bias_activation, priority=15, description="GEMM with bias + GELU epilogue"),
    # The residual add with no norm after it: the last add of a block that a graph ends with (FSDP2
    # makes dynamo compile one graph per block), or an add whose norm no norm rule could take.
    Rule("allreduce",
         Pattern.chain(OpSpec("allreduce", "AllReduce"),
                       OpSpec("bias", "Bias", optional=True, where=[bias_matches_input]),
                       OpSpec("add", "AddExtraInput", optional=True)),
         _residual_norm_builder(FusedAllReduce), priority=10,
         description="all-reduce (+ bias) (+ residual add) through the peer-memory kernels"),
    Rule("fp8_linear",
         Pattern.chain(OpSpec("quantize", "Quantize", optional=True), OpSpec("linear", "BasicLinear", where=[is_fp8]),
                       OpSpec("bias", "Bias", optional=True, where=[bias_matches_input])),
         build_fp8_linear, priority=16, where=[quantize_fits_gemm],
         description="FP8 GEMM (torch._scaled_mm) with the input's quantization and the bias epilogue; FP8 "
                     "backward GEMMs"),
    Rule("grouped_linear_fp8", Pattern.chain(OpSpec("gemm", "BasicGroupedLinear", where=[is_fp8])),
         build_grouped_linear_fp8, priority=5,
         description="FP8 grouped GEMM (torch._scaled_grouped_mm), device group sizes, FSDP weights gathered as FP8"),
    Rule("quantize", Pattern.chain(OpSpec("quantize", "Quantize")), build_quantize, priority=1,
         description="activation to FP8 (Triton amax + cast kernels)"),
    Rule("grouped_linear", Pattern.chain(OpSpec("gemm", "BasicGroupedLinear", where=[not_fp8])), build_grouped_linear, priority=5,
         description="grouped GEMM with device group sizes (Triton / torch._grouped_mm / reference)"),
]
