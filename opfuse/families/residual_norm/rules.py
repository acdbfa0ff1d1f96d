"""The residual-norm family's fusion rules (highest priority first).

==============================  ==================================================================  ====
rule                            pattern                                                             prio
==============================  ==================================================================  ====
allreduce_add_rmsnorm_quantize  AllReduce -> ... -> RMSNorm -> Quantize (as allreduce_add_rmsnorm)  45
allreduce_add_rmsnorm           AllReduce -> [Bias] -> [AddExtraInput] -> [MakeExtraOutput] -> RMSNorm   40
allreduce_add_layernorm         same, LayerNorm                                                       40
add_rmsnorm_quantize            [Bias] -> [AddExtraInput] -> [MakeExtraOutput] -> RMSNorm -> Quantize  35
add_layernorm_quantize          same, LayerNorm                                                       35
add_rmsnorm                     [Bias] -> [AddExtraInput] -> [MakeExtraOutput] -> RMSNorm             20
add_layernorm                   same, LayerNorm                                                       20
allreduce                       AllReduce -> [Bias] -> [AddExtraInput]                                10
==============================  ==================================================================  ====

Each rule's replacement is the fused op of the same name. The norms that emit FP8 outrank the FP8
all-gather (``collective_linear``) so that, in a sequence-parallel block, the norm quantizes and
the all-gather moves its bytes; the all-reduce + norm that emits FP8 outranks the one that does not.
"""

from __future__ import annotations

import torch

from ...machinery.pattern import OpSpec, Pattern
from ...machinery.predicates import bias_matches_input, norm_params_match_input, one_group
from ...machinery.rule import Match, Replacement, Rule
from .op import (AddLayerNorm, AddLayerNormQuantize, AddRMSNorm, AddRMSNormQuantize, AllReduceAddLayerNorm,
                 AllReduceAddRMSNorm, AllReduceAddRMSNormQuantize, FusedAllReduce)

__all__ = ["RULES"]


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


RULES = (
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
    Rule("add_rmsnorm", _norm_chain("RMSNorm", reduce=False), _residual_norm_builder(AddRMSNorm), priority=20,
         description="(bias +) (residual add +) RMSNorm in one pass"),
    Rule("add_layernorm", _norm_chain("LayerNorm", reduce=False), _residual_norm_builder(AddLayerNorm),
         priority=20, description="(bias +) (residual add +) LayerNorm in one pass"),
    # The residual add with no norm after it: the last add of a block that a graph ends with (FSDP2
    # makes dynamo compile one graph per block), or an add whose norm no norm rule could take.
    Rule("allreduce",
         Pattern.chain(OpSpec("allreduce", "AllReduce"),
                       OpSpec("bias", "Bias", optional=True, where=[bias_matches_input]),
                       OpSpec("add", "AddExtraInput", optional=True)),
         _residual_norm_builder(FusedAllReduce), priority=10,
         description="all-reduce (+ bias) (+ residual add) through the peer-memory kernels"),
)
