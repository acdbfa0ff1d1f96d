"""Decode attention by the split-over-positions Triton kernels (:mod:`.triton_kernels`): enough
programs to fill the GPU even for one sequence and a few key/value heads, which the fused SDPA
kernels, one block per (sequence, head) streaming the whole cache, do not."""

from __future__ import annotations

import functools
import os

import torch

from ...machinery.implementation import CallSpec
from ...runtime.triton_launch import launch

__all__ = ["check", "forward", "splits_for"]

BLOCK_N = 64  # cache positions per step of a program
S_BLOCK = 32  # splits the combine kernel loads at once
STAGES = 2  # the partial kernel's software pipeline: one tile's loads in flight under another's math
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=None)
def _triton_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return f"triton is not installed ({err})"
    return None


def check(spec: CallSpec) -> str | None:
    """None when the kernels take the call: CUDA, triton, 16- or 32-bit floats, a head dim of at
    most 256, keys and values of the query's dtype and head dim."""
    q, k, v = spec.inputs["x"], spec.inputs["key"], spec.inputs["value"]
    if torch.device(q.device).type != "cuda":
        return f"runs on CUDA devices (the query is on {q.device})"
    reason = _triton_reason()
    if reason:
        return reason
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"query / key / value dtypes {q.dtype} / {k.dtype} / {v.dtype} (one of {list(_DTYPES)} for all three)"
    if q.shape[-1] > 256 or k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        return f"head dims {q.shape[-1]} / {k.shape[-1]} / {v.shape[-1]} (one head dim of at most 256)"
    return None


def splits_for(programs: int, length: int, sms: int) -> tuple[int, int]:
    """``(splits, positions per split)`` for ``programs`` (sequence, key/value head) pairs over a
    cache of ``length``: about two programs per SM, each split a whole number of BLOCK_N steps."""
    steps = max(1, -(-length // BLOCK_N))
    splits = max(1, min(steps, -(-2 * sms // max(programs, 1))))
    per_split = -(-steps // splits) * BLOCK_N
    return -(-length // per_split), per_split


@functools.lru_cache(maxsize=None)
def _interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``; read once, as
    ``triton.jit`` reads it when the kernels' module is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """:func:`.reference.forward`'s result from the Triton kernels."""
    from .triton_kernels import combine_kernel, partial_kernel

    batch, heads, _, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    out = torch.empty(batch, heads, 1, dim, dtype=q.dtype, device=q.device)
    if batch == 0 or heads == 0:
        return out
    q3 = q[:, :, 0, :]
    if q3.stride(-1) != 1:
        q3 = q3.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if mask is not None:
        rows = mask[:, 0, 0, :]  # [Bm, L]; one mask for every head and query (the pass checks it)
        kind = 1 if rows.dtype == torch.bool else 2
        if kind == 1:
            rows = rows.view(torch.uint8)
        stride_mb = 0 if rows.shape[0] == 1 else rows.stride(0)
        stride_ml = rows.stride(1)
    else:
        rows, kind, stride_mb, stride_ml = q3, 0, 0, 0
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    splits, per_split = splits_for(batch * kv_heads, length, sms)
    g_pad, block_d = _pow2(groups, 16), _pow2(dim, 16)
    acc = torch.empty(batch * kv_heads * splits * g_pad, block_d, dtype=torch.float32, device=q.device)
    m = torch.empty(batch * kv_heads * splits * g_pad, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    launch(partial_kernel, (batch * kv_heads, splits), q3, k, v, rows, acc, m, l_sum, q3.stride(0), q3.stride(1),
           k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), stride_mb, stride_ml,
           kv_heads, length, per_split, per_split // BLOCK_N, splits, float(scale), G=groups, G_PAD=g_pad, D=dim,
           BLOCK_D=block_d, BLOCK_N=BLOCK_N, MASK=kind, IEEE=q.dtype == torch.float32, STAGES=STAGES,
           PIPELINED=not _interpreted(), num_warps=4)
    out3 = out[:, :, 0, :]
    launch(combine_kernel, (batch * kv_heads, groups), acc, m, l_sum, out3, splits, out3.stride(0), out3.stride(1),
           kv_heads, G=groups, G_PAD=g_pad, D=dim, BLOCK_D=block_d, S_BLOCK=min(S_BLOCK, _pow2(splits)), num_warps=4)
    return out
