"""``linear_bias_activation`` through cuBLASLt's bias + GELU epilogue (``torch._addmm_activation``):
the pre-activation never goes to memory. Inference only (backward needs the pre-activation) and
tanh GELU only (the epilogue's form)."""

from __future__ import annotations

import torch

from ...ops.base import dtype_name

__all__ = ["check", "forward"]


def check(spec) -> str | None:
    if spec.device.type != "cuda":
        return "needs a CUDA device"
    if spec.attrs["activation"] != "gelu_tanh":
        return "the cuBLASLt GELU epilogue is the tanh approximation; exact GELU uses the reference"
    if spec.requires_grad:
        return "training needs the pre-activation, which the epilogue does not return"
    if spec.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {dtype_name(spec.dtype)} not supported by cuBLASLt epilogues"
    return None


def forward(x, weight, bias, activation, save_pre):
    rows = x.reshape(-1, x.shape[-1])
    y = torch._addmm_activation(bias, rows, weight.t(), use_gelu=True)
    return y.reshape(x.shape[:-1] + (weight.shape[0],)), x.new_empty(0)
