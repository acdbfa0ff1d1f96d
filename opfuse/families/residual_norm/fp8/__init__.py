"""The FP8 epilogue of the residual norms (``*_quantize``: the norm's output emitted as FP8 bytes and
scales): the peer-memory kernels with the cast in their row finish (:mod:`.cuda`) and one Triton
kernel per row for the local norm (:mod:`.triton_impl`). The fused ops are in ``residual_norm/op.py``
with the rest of the family (they share its custom-op template)."""
