"""``torch._grouped_mm`` as an implementation of ``grouped_linear`` (its sync-free bf16 path).

torch's CUTLASS grouped GEMM takes cumulative int32 offsets on the device and never reads them on
the host, but only on its fast path: bfloat16 operands on sm90/sm100, rows 16-byte aligned
(``K`` and ``N`` multiples of 8) and fewer than 1024 groups. Elsewhere ``_grouped_mm`` falls back
to a loop that copies the offsets to the host, so the capability check rejects those cases
instead of letting a sync slip in. It has no bias epilogue (the check rejects a bias).

Two gaps are closed with small Triton kernels (:mod:`.triton_kernels`), so the results follow the
op's contract: rows past ``offs[-1]`` of the output and of ``dx`` are left uninitialised by torch
and are zeroed here, and the weight gradient of a group without rows is written as zeros rather
than trusted to the GEMM (not every torch version and architecture writes them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...ops.base import dtype_name
from ...runtime.triton_launch import launch
from .triton_impl import triton_status

__all__ = ["check", "forward", "backward", "device_offsets", "zero_tail_rows", "zero_empty_groups"]

_MAX_GROUPS = 1023


def check(spec) -> str | None:
    if spec.device.type != "cuda":
        return "needs a CUDA device"
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if spec.dtype != torch.bfloat16 or spec.inputs["weight"].dtype != torch.bfloat16:
        return f"dtype {dtype_name(spec.dtype)}: only bfloat16 runs without a host sync in torch._grouped_mm"
    major, minor = torch.cuda.get_device_capability(spec.device)
    if major not in (9, 10):
        return f"compute capability {major}.{minor}: torch's sync-free grouped GEMM needs sm90 or sm100"
    groups, n, k = spec.inputs["weight"].shape
    if k % 8 or n % 8:
        return f"in_features {k} / out_features {n} must be multiples of 8 (16-byte rows)"
    if groups > _MAX_GROUPS:
        return f"{groups} groups (torch._grouped_mm takes at most {_MAX_GROUPS})"
    if spec.inputs.get("bias") is not None:
        return "torch._grouped_mm has no bias epilogue"
    reason = triton_status()
    if reason:
        return f"needs triton for its tail/empty-group fix-ups: {reason}"
    return None


def device_offsets(group_sizes: Tensor, tokens: int) -> Tensor:
    """Cumulative int32 end offsets, clamped like the Triton kernels (``[0, tokens]``, monotone)."""
    ends = torch.cumsum(group_sizes.clamp(min=0), 0, dtype=torch.int64).clamp_(max=tokens)
    return ends.to(torch.int32)


def _aligned(t: Tensor) -> Tensor:
    # _grouped_mm requires 16-byte aligned base pointers (views can be offset).
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def zero_tail_rows(out: Tensor, group_sizes: Tensor) -> None:
    """Zero the rows of ``out [T, N]`` at or past ``min(sum(max(group_sizes, 0)), T)`` (one launch;
    programs wholly below that exit at once)."""
    import triton

    from .triton_impl import _next_pow2
    from .triton_kernels import zero_tail_rows_kernel

    tokens, n = out.shape
    groups = group_sizes.shape[0]
    launch(zero_tail_rows_kernel, (triton.cdiv(tokens, 64),), out, group_sizes, groups, tokens, n, out.stride(0),
           BM=64, BN=128, GP=_next_pow2(groups + 1), num_warps=4)


def zero_empty_groups(dw: Tensor, group_sizes: Tensor, tokens: int) -> None:
    """Zero ``dw[g]`` of every group ``g`` without rows (one launch; the other groups' programs exit
    at once)."""
    from .triton_impl import _next_pow2
    from .triton_kernels import zero_empty_groups_kernel

    groups = dw.shape[0]
    per_group = dw[0].numel()
    launch(zero_empty_groups_kernel, (groups, 64), dw, group_sizes, groups, tokens, per_group, BLOCK=2048,
           GP=_next_pow2(groups + 1), num_warps=4)


def forward(x, group_sizes, weight, bias):
    tokens = x.shape[0]
    if tokens == 0:
        return x.new_zeros(0, weight.shape[1])
    offs = device_offsets(group_sizes, tokens)
    y = torch._grouped_mm(_aligned(x), _aligned(weight).transpose(-2, -1), offs=offs)
    zero_tail_rows(y, group_sizes)
    return y


def backward(dy, x, group_sizes, weight, *, need_dx, need_dw, need_db):
    empty = dy.new_empty(0)
    tokens = dy.shape[0]
    if tokens == 0:
        return (torch.zeros_like(x) if need_dx else empty,
                dy.new_zeros(weight.shape) if need_dw else empty,
                dy.new_zeros(weight.shape[:2]) if need_db else empty)
    offs = device_offsets(group_sizes, tokens)
    dy = _aligned(dy)
    dx, dw = empty, empty
    if need_dx:
        dx = torch._grouped_mm(dy, _aligned(weight), offs=offs)
        zero_tail_rows(dx, group_sizes)
    if need_dw:
        # dW[g] = dy_g.T @ x_g: both operands ragged along the tokens (the "2d x 2d" form).
        dw = torch._grouped_mm(dy.t(), _aligned(x), offs=offs)
        zero_empty_groups(dw, group_sizes, tokens)
    if need_db:
        raise RuntimeError("grouped_linear torch_grouped_mm: no bias support (the capability check rejects it)")
    return dx, dw, empty
