"""Fusion/lowering rules contributed by the grouped GEMM backend (issue 6)."""

GROUPED_RULES: list = []
