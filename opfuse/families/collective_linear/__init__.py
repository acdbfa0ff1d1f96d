"""GEMMs fused with their tensor-parallel collective: all-gather + GEMM and GEMM + reduce-scatter,
in bf16 and FP8.

Modules, in the order a call goes through them: :mod:`.op` (the fused ops and their custom ops),
:mod:`.reference`, :mod:`.p2p` (the ``p2p_overlap`` implementation: checks, preparation and the
calls that run an overlap plan), :mod:`.overlap` (the plans it runs: planner, policy, instruction
set, schedules, resources, executor, CPU simulator), :mod:`.cublasmp` (cuBLASMp, optional),
:mod:`.operands` (what the implementations accept), :mod:`.fp8` (the FP8 variants),
:mod:`.implementations` (each op's implementations in order) and :mod:`.rules`.
"""

from ...machinery.family import Family
from .implementations import TABLE
from .rules import RULES

FAMILY = Family('collective_linear', TABLE, RULES)
