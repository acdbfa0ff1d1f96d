"""The ``triton`` implementation of ``gated_activation``: its capability check and launchers.

Any float dtype of the GPU paths (bfloat16, float16, float32), sm80 and newer, no host
synchronisation (CUDA-graph capturable). ``triton`` is imported only inside the launchers, after
the check, so CPU-only installs never import it.
"""

from __future__ import annotations

import torch

from ...runtime.device import triton_gpu_reason
from ...runtime.triton_launch import launch

__all__ = ["check", "forward", "backward"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


def check(spec) -> str | None:
    return triton_gpu_reason(spec, _DTYPES, 8)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D matrix with unit column stride (a view when it already is one)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _grid(rows: int, n: int):
    block = 1024 if rows >= 64 else 256  # few rows: more, smaller programs to fill the SMs
    return (rows, -(-n // block)), block


def forward(y, activation):
    from . import triton_kernels as kernels

    n = y.shape[-1] // 2
    y2 = _rows(y)
    out = y.new_empty(tuple(y.shape[:-1]) + (n,))
    if y2.shape[0] and n:
        grid, block = _grid(y2.shape[0], n)
        launch(kernels.gated_forward_kernel, grid, y2, out, n, y2.stride(0), n, ACT=_ACTIVATIONS[activation],
               BLOCK=block)
    return out


def backward(dout, y, activation):
    from . import triton_kernels as kernels

    n = y.shape[-1] // 2
    y2, d2 = _rows(y), _rows(dout)
    dy = torch.empty_like(y, memory_format=torch.contiguous_format)
    if y2.shape[0] and n:
        grid, block = _grid(y2.shape[0], n)
        launch(kernels.gated_backward_kernel, grid, d2, y2, dy, n, d2.stride(0), y2.stride(0), 2 * n,
               ACT=_ACTIVATIONS[activation], BLOCK=block)
    return dy
