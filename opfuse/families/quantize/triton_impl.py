"""The ``triton`` implementation of the ``quantize`` fused op (:mod:`.kernels`)."""

from __future__ import annotations

from ...runtime.device import triton_status
from . import kernels
from .reference import quantize_with

__all__ = ["check", "forward"]


def check(spec) -> str | None:
    if spec.device.type != "cuda":
        return "needs a CUDA device"
    return triton_status()


def forward(x, dtype, rowwise, amax_group):
    return quantize_with(kernels.quantize, kernels.amax, x, dtype, rowwise, amax_group)
