"""One GEMM with its epilogue: GEMM + bias + GELU (``linear_bias_activation``) and the FP8 GEMM with
its input's quantization and bias (``fp8_linear``, in :mod:`.fp8`).

Modules: :mod:`.op`, :mod:`.reference`, :mod:`.cublaslt`, :mod:`.cudnn` (optional),
:mod:`.implementations`, :mod:`.rules`.
"""

from ...machinery.family import Family
from .implementations import TABLE
from .recognizers import RECOGNIZERS
from .rules import RULES

FAMILY = Family('linear', TABLE, RULES, recognizers=RECOGNIZERS)
