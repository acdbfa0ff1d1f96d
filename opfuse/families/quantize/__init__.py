"""FP8 quantization of activations: the fused op ``quantize`` (a ``Quantize`` op no other fusion
took), its reference (:mod:`opfuse.fp8.numerics` in torch ops) and Triton kernels, and
:func:`.kernels.quantize`, the fast quantizer the other FP8 implementations call."""

from ...machinery.family import Family
from .implementations import TABLE
from .rules import RULES

FAMILY = Family('quantize', TABLE, RULES)
