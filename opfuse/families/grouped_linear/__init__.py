"""The grouped GEMM of ``GroupedLinear`` (mixture-of-experts): the fused op ``grouped_linear`` and
its custom ops (:mod:`.op`), the reference (:mod:`.reference`), opfuse's Triton kernels
(:mod:`.triton_impl`, :mod:`.triton_kernels`; persistent: :mod:`.persistent`,
:mod:`.persistent_kernels`), ``torch._grouped_mm`` (:mod:`.torch_mm`) and the measured choices
per GPU kind and size class (:mod:`.tuning`).

======================  ======================================================================
implementation          runs where
======================  ======================================================================
``triton_tma``          own Triton kernels, TMA operand loads; sm90+, bf16/fp16/fp32, K rows 16 B
``torch_grouped_mm``    ``torch._grouped_mm`` (CUTLASS); sm90/sm100, bf16, K and N % 8, no bias
``triton``              own Triton kernels, pointer loads; sm80+, bf16/fp16/fp32, any sizes
``triton_persistent``   persistent Triton kernel, TMA loads, warp-specialised large tiles; sm90+,
                        bf16/fp16, K and N % 8, at most 1023 groups
``reference``           loop of matmuls over host group sizes; any device and dtype (syncs)
======================  ======================================================================

Every GPU entry keeps the group sizes on the device (no host sync, CUDA-graph capturable). Their
order is in :mod:`.implementations`; on a GPU kind measured by
``bench/grouped_tune.py`` the measured order of the call's size class comes first
(:mod:`.tuning`; measurements: docs/PERF_NOTES.grouped.md). ``OPFUSE_FORCE_IMPL=grouped_linear=<name>``
picks one.
"""

from ...machinery.family import Family
from .implementations import TABLE
from .recognizers import RECOGNIZERS
from .rules import RULES

FAMILY = Family('grouped_linear', TABLE, RULES, recognizers=RECOGNIZERS)
