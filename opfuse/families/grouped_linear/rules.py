"""The grouped-linear family's fusion rules: a grouped GEMM onto the implementation table (it merges
nothing), in bf16 or FP8 (``(fp8)``: marked by the FP8 pass under :func:`opfuse.fp8.autocast`).

=====================  ========================  ====
rule                   pattern                   prio
=====================  ========================  ====
grouped_linear_fp8     BasicGroupedLinear(fp8)   5
grouped_linear         BasicGroupedLinear        5
=====================  ========================  ====
"""

from __future__ import annotations

from ...machinery.pattern import OpSpec, Pattern
from ...machinery.predicates import is_fp8, not_fp8
from ...machinery.rule import Match, Replacement, Rule
from .fp8.op import GroupedGemmFp8
from .op import GroupedGemm

__all__ = ["RULES"]


def build_grouped_linear(match: Match) -> Replacement:
    module = GroupedGemm.from_op(match["gemm"].op)
    return Replacement(module, [match.input("gemm", 0), match.input("gemm", 1)])


def build_grouped_linear_fp8(match: Match) -> Replacement:
    return Replacement(GroupedGemmFp8.from_op(match["gemm"].op), [match.input("gemm", 0), match.input("gemm", 1)])


RULES = (
    Rule("grouped_linear_fp8", Pattern.chain(OpSpec("gemm", "BasicGroupedLinear", where=[is_fp8])),
         build_grouped_linear_fp8, priority=5,
         description="FP8 grouped GEMM (torch._scaled_grouped_mm), device group sizes, FSDP weights gathered as FP8"),
    Rule("grouped_linear", Pattern.chain(OpSpec("gemm", "BasicGroupedLinear", where=[not_fp8])), build_grouped_linear,
         priority=5, description="grouped GEMM with device group sizes (Triton / torch._grouped_mm / reference)"),
)
