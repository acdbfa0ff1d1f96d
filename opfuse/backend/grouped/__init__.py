"""Grouped GEMM backend for ``GroupedLinear`` (mixture-of-experts): the ``grouped_linear`` entries
of the dispatch table, the custom op and fused module (:mod:`.fused`), and the rule that puts it
in compiled programs (:mod:`.rules`).

======================  ======================================================================
implementation          runs where
======================  ======================================================================
``triton_tma``          own Triton kernels, TMA operand loads; sm90+, bf16/fp16/fp32, K rows 16 B
``torch_grouped_mm``    ``torch._grouped_mm`` (CUTLASS); sm90/sm100, bf16, K and N % 8, no bias
``triton``              own Triton kernels, pointer loads; sm80+, bf16/fp16/fp32, any sizes
``reference``           loop of matmuls over host group sizes; any device and dtype (syncs)
======================  ======================================================================

Every GPU entry keeps the group sizes on the device (no host sync, CUDA-graph capturable).
The order is a prediction until measured (see docs/PERF_NOTES.grouped.md); ``OPFUSE_FORCE_IMPL=
grouped_linear=<name>`` picks one.
"""

from __future__ import annotations

from ..dispatch import Implementation

__all__ = ["implementations"]


def _always(spec) -> None:
    return None


def implementations() -> list[Implementation]:
    """All implementations of ``grouped_linear``, in the order tried (the last one always capable)."""
    # Plain-Python modules: triton itself is imported only when a GPU entry runs.
    from . import reference, torch_mm, triton_impl

    # Order measured on H100 (bench/grouped.py, docs/PERF_NOTES.md): the pointer-load Triton kernel
    # beat the TMA variant and torch._grouped_mm on both the large and the decode shape.
    return [
        Implementation("triton", triton_impl.check, triton_impl.forward, triton_impl.backward,
                       "Triton grouped GEMM, pointer loads (any size), device group sizes"),
        Implementation("triton_tma", triton_impl.check_tma, triton_impl.forward_tma, triton_impl.backward_tma,
                       "Triton grouped GEMM, TMA loads, device group sizes, fused bias, zeroed tail"),
        Implementation("torch_grouped_mm", torch_mm.check, torch_mm.forward, torch_mm.backward,
                       "torch._grouped_mm (CUTLASS) with device offsets, tail and empty groups zeroed"),
        Implementation("reference", _always, reference.reference_forward, reference.reference_backward,
                       "loop of matmuls over host group sizes (syncs on a GPU)"),
    ]
