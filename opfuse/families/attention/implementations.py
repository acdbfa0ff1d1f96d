"""The attention family's implementations: the Triton split-over-positions kernels, then SDPA."""

from __future__ import annotations

from ...machinery.implementation import Implementation, ImplementationTable, always
from . import reference as attention_reference
from . import triton_impl as attention_triton

__all__ = ["TABLE"]

TABLE = ImplementationTable("attention", {
    "decode_attention": [
        Implementation("triton", attention_triton.check, attention_triton.forward,
                       description="split over the cache's positions (flash-decoding), query groups as rows"),
        Implementation("reference", always, attention_reference.forward,
                       description="query groups folded into positions, F.scaled_dot_product_attention"),
    ],
})
