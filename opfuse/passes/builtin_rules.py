"""The built-in fusion rules, as one readable list (:data:`BUILTIN_RULES`).

Priorities: larger fusions and those that hide communication go first.

=============================  ==================================================================  ====
rule                           pattern                                                             prio
=============================  ==================================================================  ====
allreduce_add_rmsnorm          AllReduce -> [Bias] -> [AddExtraInput] -> [MakeExtraOutput] -> RMSNorm   40
allreduce_add_layernorm        same, LayerNorm                                                       40
all_gather_linear              AllGather -> BasicLinear -> [Bias]                                    30
linear_reduce_scatter          BasicLinear -> ReduceScatter -> [Bias]                                30
linear_bias_reduce_scatter     BasicLinear -> Bias -> ReduceScatter                                  30
add_rmsnorm                    [Bias] -> [AddExtraInput] -> [MakeExtraOutput] -> RMSNorm             20
add_layernorm                  same, LayerNorm                                                       20
linear_bias_activation         BasicLinear -> Bias -> GELU                                           15
allreduce                      AllReduce -> [Bias]                                                   10
grouped_linear                 BasicGroupedLinear                                                     5
=============================  ==================================================================  ====

Each rule's replacement is the fused op of the same name, except ``linear_bias_reduce_scatter``
(``linear_reduce_scatter`` with the bias on every partial sum). ``grouped_linear`` merges nothing:
it moves the grouped GEMM onto the implementation table.
"""

from __future__ import annotations

from ..backend.collective_linear.op import AllGatherLinear, LinearReduceScatter
from ..backend.grouped_linear.op import GroupedGemm
from ..backend.linear_activation.op import LinearBiasActivation
from ..backend.residual_norm.op import (
    AddLayerNorm,
    AddRMSNorm,
    AllReduceAddLayerNorm,
    AllReduceAddRMSNorm,
    FusedAllReduce,
)
from .pattern import OpSpec, Pattern
from .predicates import bias_matches_input, norm_params_match_input, one_group
from .rule import Match, Replacement, Rule

__all__ = ["BUILTIN_RULES"]


# Builders -------------------------------------------------------------------------------------


def _residual_norm_builder(cls):
    def build(match: Match) -> Replacement:
        reduce, bias, add = match.get("allreduce"), match.get("bias"), match.get("add")
        extra, norm = match.get("extra"), match.get("norm")
        kwargs = {"bias": bias.op.bias if bias else None}
        if reduce is not None:
            kwargs["group"] = reduce.op.group
        if norm is not None:
            kwargs.update(weight=norm.op.weight, norm_bias=getattr(norm.op, "bias", None), eps=norm.op.eps,
                          has_residual=add is not None, export_residual=extra is not None)
        first = match.ordered()[0].name
        args = [match.input(first)] + ([match.input("add", 1)] if add is not None else [])
        outputs = {"norm": 0} if norm is not None else {match.ordered()[-1].name: 0}
        if extra is not None:
            outputs["extra"] = 1
        return Replacement(cls(**kwargs), args, outputs)

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


# Patterns -------------------------------------------------------------------------------------


def _norm_chain(norm_kind: str, reduce: bool) -> Pattern:
    specs = []
    if reduce:
        specs.append(OpSpec("allreduce", "AllReduce"))
    specs += [
        OpSpec("bias", "Bias", optional=True, where=[bias_matches_input]),
        OpSpec("add", "AddExtraInput", optional=True),
        OpSpec("extra", "MakeExtraOutput", optional=True, exported=True),
        OpSpec("norm", norm_kind, where=[norm_params_match_input]),
    ]
    return Pattern.chain(*specs)


BUILTIN_RULES = [
    Rule("allreduce_add_rmsnorm", _norm_chain("RMSNorm", reduce=True), _residual_norm_builder(AllReduceAddRMSNorm),
         priority=40, where=[one_group],
         description="all-reduce + bias + residual add + RMSNorm in one peer-memory kernel"),
    Rule("allreduce_add_layernorm", _norm_chain("LayerNorm", reduce=True),
         _residual_norm_builder(AllReduceAddLayerNorm), priority=40, where=[one_group],
         description="all-reduce + bias + residual add + LayerNorm"),
    Rule("all_gather_linear",
         Pattern.chain(OpSpec("gather", "AllGather"), OpSpec("linear", "BasicLinear"),
                       OpSpec("bias", "Bias", optional=True, where=[bias_matches_input])),
         build_all_gather_linear, priority=30,
         description="token all-gather overlapped with the column-parallel GEMM"),
    Rule("linear_reduce_scatter",
         Pattern.chain(OpSpec("linear", "BasicLinear"), OpSpec("scatter", "ReduceScatter"),
                       OpSpec("bias", "Bias", optional=True, where=[bias_matches_input])),
         build_linear_reduce_scatter, priority=30,
         description="row-parallel GEMM overlapped with the token reduce-scatter; bias after the reduction"),
    Rule("linear_bias_reduce_scatter",
         Pattern.chain(OpSpec("linear", "BasicLinear"), OpSpec("bias", "Bias", where=[bias_matches_input]),
                       OpSpec("scatter", "ReduceScatter")),
         build_linear_bias_reduce_scatter, priority=30,
         description="GEMM + per-rank bias overlapped with the token reduce-scatter"),
    Rule("add_rmsnorm", _norm_chain("RMSNorm", reduce=False), _residual_norm_builder(AddRMSNorm), priority=20,
         description="(bias +) (residual add +) RMSNorm in one pass"),
    Rule("add_layernorm", _norm_chain("LayerNorm", reduce=False), _residual_norm_builder(AddLayerNorm),
         priority=20, description="(bias +) (residual add +) LayerNorm in one pass"),
    Rule("linear_bias_activation",
         Pattern.chain(OpSpec("linear", "BasicLinear"), OpSpec("bias", "Bias", where=[bias_matches_input]),
                       OpSpec("act", "GELU")),
         build_linear_bias_activation, priority=15, description="GEMM with bias + GELU epilogue"),
    Rule("allreduce",
         Pattern.chain(OpSpec("allreduce", "AllReduce"),
                       OpSpec("bias", "Bias", optional=True, where=[bias_matches_input])),
         _residual_norm_builder(FusedAllReduce), priority=10,
         description="all-reduce (+ bias) through the peer-memory kernels"),
    Rule("grouped_linear", Pattern.chain(OpSpec("gemm", "BasicGroupedLinear")), build_grouped_linear, priority=5,
         description="grouped GEMM with device group sizes (Triton / torch._grouped_mm / reference)"),
]
