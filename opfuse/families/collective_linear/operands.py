"""What every comm + GEMM implementation checks first: CUDA tensors, a half-precision dtype shared
by input, weight and bias, and a group of at least two ranks (pure: metadata only)."""

from __future__ import annotations

from typing import Optional

import torch

from ...ops.base import dtype_name

__all__ = ["HALF_DTYPES", "operand_reason"]

#: The dtypes the comm + GEMM implementations run (float32 runs the reference).
HALF_DTYPES = (torch.bfloat16, torch.float16)


def operand_reason(spec) -> Optional[str]:
    """``None`` when ``spec``'s operands suit a comm + GEMM implementation, else why not."""
    x, w, b = spec.x, spec.inputs["weight"], spec.inputs.get("bias")
    if torch.device(x.device).type != "cuda":
        return f"needs CUDA tensors (x is on {x.device})"
    if x.dtype not in HALF_DTYPES:
        return f"dtype {dtype_name(x.dtype)} not supported (bfloat16, float16; float32 runs the reference)"
    if w.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
        return (f"mixed dtypes (x {dtype_name(x.dtype)}, weight {dtype_name(w.dtype)}"
                f"{', bias ' + dtype_name(b.dtype) if b is not None else ''})")
    if spec.world_size < 2:
        return "group has one rank: nothing to overlap"
    if spec.group_name is None:
        return "no process group"
    return None
