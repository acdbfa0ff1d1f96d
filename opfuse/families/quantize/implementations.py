"""The quantize family's implementations: the Triton amax + cast kernels, then torch ops."""

from __future__ import annotations

from ...machinery.implementation import Implementation, ImplementationTable, always
from . import reference as quantize_reference
from . import triton_impl as quantize_triton

__all__ = ["TABLE"]

TABLE = ImplementationTable("quantize", {
    "quantize": [
        Implementation("triton", quantize_triton.check, quantize_triton.forward,
                       description="amax + cast kernels (per tensor) or one pass per row"),
        Implementation("reference", always, quantize_reference.forward, description="torch ops"),
    ],
})
