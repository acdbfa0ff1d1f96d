"""GEMMs fused with their tensor-parallel collective: all-gather + GEMM and GEMM + reduce-scatter.

Modules, in the order a call goes through them: :mod:`.op` (the fused ops and their custom ops),
:mod:`.reference`, :mod:`.p2p` (the ``p2p_overlap`` implementation), :mod:`.plans` (what a call
runs: schedule, channels, regions), :mod:`.policy` (grids and sizes, pure Python), :mod:`.plan`
(the instruction set of per-rank plans), :mod:`.schedules` (the schedules as plan builders),
:mod:`.resources` (pools, contexts, region names), :mod:`.executor` (a plan compiled to
straight-line Python on CUDA), :mod:`.simulate` (a CPU interpreter of plans the tests use).
"""

from ...machinery.family import Family
from .implementations import TABLE
from .rules import RULES

FAMILY = Family('collective_linear', TABLE, RULES)
