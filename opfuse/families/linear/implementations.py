"""The linear family's implementations: the GEMM with a bias + GELU epilogue (cuBLASLt, cuDNN
(optional), reference) and its FP8 variant (``torch._scaled_mm``, float32 emulation)."""

from __future__ import annotations

from ...machinery.implementation import Implementation, ImplementationTable, always
from . import cublaslt
from . import cudnn as activation_cudnn
from . import reference as activation_reference
from .fp8 import reference as fp8_linear_reference
from .fp8 import scaled_mm

__all__ = ["TABLE"]

TABLE = ImplementationTable("linear", {
    "linear_bias_activation": [
        Implementation("cublaslt_epilogue", cublaslt.check, cublaslt.forward, activation_reference.backward,
                       description="cuBLASLt GEMM with bias+GELU(tanh) epilogue"),
        Implementation(activation_cudnn.NAME, activation_cudnn.check, activation_cudnn.forward,
                       activation_reference.backward, activation_cudnn.prepare,
                       "cuDNN frontend matmul + bias + GELU (exact or tanh) graph, pre-activation kept for "
                       "training; optional: opfuse[cudnn]"),
        Implementation("reference", always, activation_reference.forward, activation_reference.backward,
                       description="addmm, then gelu"),
    ],
    "fp8_linear": [
        Implementation("scaled_mm", scaled_mm.check, scaled_mm.forward, scaled_mm.backward,
                       description="torch._scaled_mm FP8 GEMMs (forward, dgrad, wgrad), cached FP8 weights, Triton "
                                   "quantizers"),
        Implementation("reference", always, fp8_linear_reference.forward, fp8_linear_reference.backward,
                       description="float32 emulation of the FP8 GEMMs (quantize -> dequantize -> matmul)"),
    ],
})
