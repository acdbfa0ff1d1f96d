"""The gated activation of a packed ``[..., 2n]`` value ``[gate | up]``: ``act(gate) * up`` in one
pass (``gated_activation``; made by the ``horizontal_gemm`` pass after it joins the gate and up
GEMMs of a ``GatedLinear``).

Modules: :mod:`.op` (the fused op and its custom ops), :mod:`.reference`, :mod:`.triton_impl`
(checks and launchers) and :mod:`.triton_kernels` (the kernels; imported only on a GPU host).
"""

from ...machinery.family import Family
from .implementations import TABLE
from .recognizers import RECOGNIZERS

FAMILY = Family('gated_activation', TABLE, recognizers=RECOGNIZERS)
