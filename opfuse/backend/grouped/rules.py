"""Fusion rules of the grouped GEMM backend: ``BasicGroupedLinear`` => :class:`GroupedGemm`.

A one-op rule: it does not merge ops, it moves the grouped GEMM onto the dispatch table, so the
compiled program runs the chosen kernel and records it in ``Program.fusions``. Imported by
:mod:`opfuse.passes.rules_builtin`; it imports only the pattern/rule data types (no rule list),
which keeps the import graph acyclic.
"""

from __future__ import annotations

from ...passes.pattern import OpSpec, Pattern
from ...passes.rule import Match, Replacement, Rule
from .fused import GroupedGemm

__all__ = ["GROUPED_RULES", "build_grouped_gemm"]


def build_grouped_gemm(match: Match) -> Replacement:
    module = GroupedGemm.from_op(match["gemm"].op)
    return Replacement(module, [match.input("gemm", 0), match.input("gemm", 1)])


GROUPED_RULES: list = [
    Rule("grouped_linear", Pattern.chain(OpSpec("gemm", "BasicGroupedLinear")), build_grouped_gemm, priority=5,
         description="grouped GEMM with device group sizes (Triton / torch._grouped_mm / reference)"),
]
