"""The fused-op families: one folder each, holding everything one kind of fusion needs.

A family folder has its fused ops (``op.py``: the ``FusedOp`` modules and their custom ops), the
reference implementation (``reference.py``), the other implementations (kernels, library calls,
``csrc/`` for CUDA sources), ``implementations.py`` (each fused op's implementations in the order
tried, reference last), ``rules.py`` (the fusion rules that build its fused ops) and, where the
torch.compile front end needs to find an op in aten graphs, ``recognizers.py``. An FP8 variant of a
family's fused ops lives in its ``fp8/`` folder.

:data:`FAMILIES` is the one list: the rule registry (:mod:`opfuse.core.rules`), the dispatch table
(:mod:`opfuse.core.dispatch`) and the torch.compile recognizers are built by iterating it. Adding a
fused op is one new folder plus one line here (docs/EXTENDING.md).
"""

from . import attention, collective_linear, gated_activation, grouped_linear, horizontal_linear, linear, quantize, residual_norm

__all__ = ["FAMILIES"]

FAMILIES = (
    residual_norm.FAMILY,       # (all-reduce +) (bias +) (residual add +) RMSNorm / LayerNorm (-> FP8)
    collective_linear.FAMILY,   # all-gather + GEMM, GEMM + reduce-scatter, overlapped (bf16, FP8)
    linear.FAMILY,              # one GEMM with its epilogue: bias + GELU; the FP8 GEMM
    grouped_linear.FAMILY,      # mixture-of-experts grouped GEMM with device group sizes (bf16, FP8)
    horizontal_linear.FAMILY,   # GEMMs reading one value as one GEMM (made by the horizontal_gemm pass)
    gated_activation.FAMILY,    # act(gate) * up of a packed [gate | up] value (horizontal_gemm pass)
    quantize.FAMILY,            # an activation to FP8 (and the quantizer every FP8 variant calls)
    attention.FAMILY,           # decode attention over a key/value cache shared by query groups (compile front end)
)
