"""Horizontal GEMM fusion: several linears that read one value, run as one GEMM over their weights
joined without a copy (``horizontal_linear``; made by the ``horizontal_gemm`` pass).

Modules: :mod:`.op` (the fused op and its custom ops), :mod:`.reference`, :mod:`.checks` (the
``p2p_overlap`` implementation of the sequence-parallel form is ``all_gather_linear``'s).
"""

from ...machinery.family import Family
from .implementations import TABLE

FAMILY = Family('horizontal_linear', TABLE)
