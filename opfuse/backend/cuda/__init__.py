"""CUDA-kernel implementations (the pybind11 extension built from ``backend/csrc``)."""

from __future__ import annotations

from ..dispatch import Implementation
from . import residual_norm as rn


def residual_norm_implementations(op: str) -> list[Implementation]:
    """Kernel implementations of ``op`` (``allreduce_add_norm``, ``add_norm``, ``allreduce``), in
    the order tried, before the reference. Thresholds: docs/PERF_NOTES.md."""
    if op == "add_norm":
        return [Implementation("cuda", rn.check_local, rn.local_forward, rn.norm_backward,
                               "fused (bias +) residual add + norm kernel")]
    return [
        Implementation("cuda_oneshot", rn.check_oneshot, rn.oneshot_forward, rn.norm_backward,
                       "one kernel: Lamport one-shot all-reduce over peer memory + add + norm"),
        Implementation("cuda_twoshot", rn.check_twoshot, rn.twoshot_forward, rn.norm_backward,
                       "one kernel: two-shot (reduce-scatter rows, all-gather) over peer memory + add + norm"),
        Implementation("nccl+cuda", rn.check_nccl_then_kernel, rn.nccl_then_kernel_forward, rn.norm_backward,
                       "NCCL all-reduce, then the fused add + norm kernel"),
    ]
