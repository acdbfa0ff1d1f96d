"""The gated-activation family's implementations: one Triton pass, then the reference."""

from __future__ import annotations

from ...machinery.implementation import Implementation, ImplementationTable, always
from . import reference as gated_reference
from . import triton_impl as gated_triton

__all__ = ["TABLE"]

TABLE = ImplementationTable("gated_activation", {
    "gated_activation": [
        Implementation("triton", gated_triton.check, gated_triton.forward, gated_triton.backward,
                       description="one pass over the packed [gate | up] rows, float32 arithmetic, rounded once"),
        Implementation("reference", always, gated_reference.forward, gated_reference.backward,
                       description="torch: the two halves, the activation, the product (float32 for half types)"),
    ],
})
