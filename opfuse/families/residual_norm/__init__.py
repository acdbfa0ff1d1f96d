"""(All-reduce +) (bias +) (residual add +) RMSNorm / LayerNorm as one fused op, optionally emitting FP8.

Modules: :mod:`.op` (the fused ops and their custom ops), :mod:`.reference`, :mod:`.cuda` (the
peer-memory kernels: one-shot, two-shot, NCCL then the local kernel; ``csrc/``), :mod:`.cudnn`
(optional), :mod:`.crossovers` (which kernel for which message size), :mod:`.fp8` (the FP8
epilogue's implementations), :mod:`.implementations`, :mod:`.rules`, :mod:`.recognizers` (RMSNorm
and LayerNorm in aten graphs, for the torch.compile front end).
"""

from ...machinery.family import Family
from .implementations import TABLE
from .recognizers import RECOGNIZERS
from .rules import RULES

FAMILY = Family('residual_norm', TABLE, RULES, recognizers=RECOGNIZERS)
