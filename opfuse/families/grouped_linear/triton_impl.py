"""opfuse's own grouped GEMM (Triton): the ``triton_tma`` and ``triton`` implementations of
``grouped_linear``, their capability checks, tile heuristics and launchers.

* Any float dtype of the GPU paths (bfloat16, float16, float32) and any sizes (odd ``K``/``N``,
  empty groups, ``sum(group_sizes) < T``), sm80 and newer.
* ``triton_tma`` (sm90+) loads the forward/dgrad operands with TMA (host tensor descriptors)
  where their alignment allows; ``triton`` uses pointer loads everywhere.
* Tile shapes come from a fixed table keyed by static shapes, never from autotuning: autotuning
  synchronises and would break CUDA-graph capture and ``set_sync_debug_mode("error")``.

``triton`` itself is imported only inside these functions, after a device check, so CPU-only
installs never import it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from ...runtime.device import triton_gpu_reason, triton_status

__all__ = ["GemmConfig", "gemm_config", "m_tile_bound", "wgrad_config", "grouped_mm", "grouped_wgrad", "check",
           "triton_gpu_reason", "wgrad_outputs", "make_backward",
           "check_tma", "forward", "backward", "forward_tma", "backward_tma", "triton_status"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_GROUPS = 4095          # every program holds the G counts in registers (a GP-lane vector)
_INT32_MAX = 2**31 - 1


@functools.lru_cache(maxsize=None)
def _tma_status() -> str | None:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return "this triton has no host tensor descriptors (triton.tools.tensor_descriptor)"
    return None


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tiles ``BM x BN x BK`` of a grouped GEMM, warps, pipeline stages, m-tiles per super-row."""

    bm: int
    bn: int
    bk: int
    num_warps: int
    num_stages: int
    group_m: int = 8


def _fit(block: int, size: int) -> int:
    """Shrink a tile side to the problem (powers of two, at least 16 for tl.dot)."""
    return max(16, min(block, _next_pow2(size)))


def gemm_config(tokens: int, groups: int, n_out: int, k_contract: int, dtype: torch.dtype,
                aligned: bool = True) -> GemmConfig:
    """Tiles for ``[T, KC] x [KC, N]`` per group, from static shapes (mean rows per group).

    Many rows per group (16-bit): 128x256x64 tiles (two warpgroups, wgmma), the usual best for
    bf16/fp16 GEMMs on H100/H200. Few rows per group (decode): the GEMM streams the weights, so
    M tiles shrink to the rows that exist and N tiles shrink so that every SM gets several
    programs. Rows not 16-byte aligned (``aligned=False``) cannot use vector or async loads:
    small tiles keep the scalar loads from spilling registers. float32 runs on FMA units unless
    TF32 is allowed: small tiles as well.
    """
    mean = tokens / max(groups, 1)
    if mean <= 16:
        bm, bn, bk, warps, stages = 16, 64, (32 if dtype == torch.float32 else 128), 4, 4
    elif dtype == torch.float32 or not aligned:
        bm, bn, bk, warps, stages = 64, 64, 32, 4, 3
    elif mean <= 32:
        bm, bn, bk, warps, stages = 32, 64, 128, 4, 4
    elif mean <= 64:
        bm, bn, bk, warps, stages = 64, 128, 64, 4, 4
    else:
        bm, bn, bk, warps, stages = 128, 256, 64, 8, 3
    return GemmConfig(bm, _fit(bn, n_out), _fit(bk, k_contract), warps, stages)


def wgrad_config(tokens: int, groups: int, n: int, k: int, dtype: torch.dtype, aligned: bool = True) -> GemmConfig:
    """Tiles ``[BN, BK]`` of ``dW[g]`` and the token step ``BT`` (stored as ``bm``)."""
    mean = tokens / max(groups, 1)
    if dtype == torch.float32 or not aligned:
        bt, bn, bk, warps, stages = 32, 64, 64, 4, 3
    else:
        bt, bn, bk, warps, stages = (32 if mean <= 32 else 64), 128, 128, 8, 3
    return GemmConfig(bt, _fit(bn, n), _fit(bk, k), warps, stages)


def m_tile_bound(tokens: int, groups: int, bm: int) -> int:
    """Upper bound of the m-tiles ``grouped_mm_kernel`` needs for any group sizes: each group's
    rows and the tail are tiled separately, so ``sum_g ceil(c_g / BM) + ceil(tail / BM)`` over the
    ``G + 1`` row ranges, which is at most ``(T + (G + 1) * (BM - 1)) // BM``."""
    return (tokens + (groups + 1) * (bm - 1)) // bm


def _precision(dtype: torch.dtype) -> str:
    # float32 follows torch's matmul setting: exact ("ieee") unless the user allowed TF32.
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _tma_aligned(t: Tensor, row_elems: int) -> bool:
    return t.data_ptr() % 16 == 0 and (row_elems * t.element_size()) % 16 == 0


def grouped_mm(a: Tensor, sizes: Tensor, weight: Tensor, *, nk: bool, bias: Tensor | None = None,
               use_tma: bool = False, out: Tensor | None = None) -> Tensor:
    """Per group ``g``: ``out[rows of g] = a[rows of g] @ (weight[g].T if nk else weight[g]) (+ bias[g])``.

    ``a [T, KC]``; ``weight [G, N, KC]`` (``nk``, the forward) or ``[G, KC, N]`` (dgrad);
    ``sizes [G]`` int32/int64 on the device; ``out [T, N]`` (allocated if ``None``; every
    element is written, the tail past ``sum(sizes)`` with zeros). ``use_tma`` loads each operand
    through TMA when its alignment allows.
    """
    import triton

    from .triton_kernels import grouped_mm_kernel

    a, weight = a.contiguous(), weight.contiguous()
    tokens, k_contract = a.shape
    groups = weight.shape[0]
    n_out = weight.shape[1] if nk else weight.shape[2]
    if (weight.shape[2] if nk else weight.shape[1]) != k_contract:
        raise ValueError(f"grouped_mm: a {list(a.shape)} and weight {list(weight.shape)} (nk={nk}) do not chain")
    if out is None:
        out = a.new_empty(tokens, n_out)
    if tokens == 0:
        return out
    pitch_b = k_contract if nk else n_out
    aligned = (k_contract * a.element_size()) % 16 == 0 and (pitch_b * a.element_size()) % 16 == 0
    cfg = gemm_config(tokens, groups, n_out, k_contract, a.dtype, aligned)
    even_k = k_contract % cfg.bk == 0
    m_tiles = m_tile_bound(tokens, groups, cfg.bm)
    a_src, b_src, a_tma, b_tma = a, weight, False, False
    if use_tma and a.element_size() == 2:
        # (float32 stays on pointer loads: its FMA dot gains nothing from TMA and the
        # transposed weight tile it would need costs registers.)
        from triton.tools.tensor_descriptor import TensorDescriptor

        if _tma_aligned(a, k_contract):
            a_src, a_tma = TensorDescriptor.from_tensor(a, [cfg.bm, cfg.bk]), True
        rows = groups * weight.shape[1]
        if nk and _tma_aligned(weight, k_contract) and rows <= _INT32_MAX:
            b_src, b_tma = TensorDescriptor.from_tensor(weight.view(rows, k_contract), [cfg.bn, cfg.bk]), True
        elif not nk and even_k and _tma_aligned(weight, n_out) and rows <= _INT32_MAX:
            b_src, b_tma = TensorDescriptor.from_tensor(weight.view(rows, n_out), [cfg.bk, cfg.bn]), True
    stride_bk, stride_bn = (1, k_contract) if nk else (n_out, 1)
    grid = (m_tiles * triton.cdiv(n_out, cfg.bn),)
    grouped_mm_kernel[grid](
        a_src, b_src, out, bias if bias is not None else out, sizes,
        tokens, n_out, k_contract, groups, m_tiles,
        a.stride(0), weight.shape[1] * weight.shape[2], stride_bk, stride_bn, out.stride(0),
        HAS_BIAS=bias is not None, A_TMA=a_tma, B_TMA=b_tma, B_NK=nk, EVEN_K=even_k,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, GP=_next_pow2(groups + 1),
        PRECISION=_precision(a.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def wgrad_outputs(dy: Tensor, groups: int, k: int, need_db: bool, dw: Tensor | None,
                  db: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The weight-gradient outputs ``dw [G, N, K]`` and (``need_db``) ``db [G, N]``, allocated
    where ``None``; zeroed when ``dy`` has no rows (no kernel runs then)."""
    n = dy.shape[1]
    if dw is None:
        dw = dy.new_empty(groups, n, k)
    if need_db and db is None:
        db = dy.new_empty(groups, n)
    if dy.shape[0] == 0:
        dw.zero_()
        if need_db:
            db.zero_()
    return dw, db


def grouped_wgrad(dy: Tensor, x: Tensor, sizes: Tensor, groups: int, *, need_db: bool,
                  dw: Tensor | None = None, db: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """``dw[g] = dy[rows of g].T @ x[rows of g]`` (``[G, N, K]``) and, with ``need_db``,
    ``db[g] = dy[rows of g].sum(0)`` (``[G, N]``). Every element is written (zeros for groups
    without rows)."""
    import triton

    from .triton_kernels import grouped_wgrad_kernel

    dy, x = dy.contiguous(), x.contiguous()
    tokens, n = dy.shape
    k = x.shape[1]
    dw, db = wgrad_outputs(dy, groups, k, need_db, dw, db)
    if tokens == 0:
        return dw, db
    aligned = (n * dy.element_size()) % 16 == 0 and (k * x.element_size()) % 16 == 0
    cfg = wgrad_config(tokens, groups, n, k, dy.dtype, aligned)
    grid = (groups * triton.cdiv(n, cfg.bn) * triton.cdiv(k, cfg.bk),)
    grouped_wgrad_kernel[grid](
        dy, x, dw, db if need_db else dw, sizes, tokens, n, k, groups, dy.stride(0), x.stride(0),
        HAS_BIAS=need_db, BN=cfg.bn, BK=cfg.bk, BT=cfg.bm, GP=_next_pow2(groups + 1),
        PRECISION=_precision(dy.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dw, db


# Dispatch-table entries ---------------------------------------------------------------------------


def check(spec) -> str | None:
    """Capability of the pointer-load kernels."""
    reason = triton_gpu_reason(spec, _DTYPES, 8)
    if reason:
        return reason
    weight = spec.inputs["weight"]
    groups, n, k = weight.shape
    if groups > _MAX_GROUPS:
        return f"{groups} groups (at most {_MAX_GROUPS})"
    if n * k > _INT32_MAX:
        return f"one expert's weight has {n * k} elements (at most 2**31 - 1)"
    return None


def check_tma(spec) -> str | None:
    """Capability of the TMA kernels: the pointer kernels' conditions plus sm90 and 16-byte rows."""
    reason = check(spec)
    if reason:
        return reason
    major, minor = torch.cuda.get_device_capability(spec.device)
    if major < 9:
        return f"TMA needs compute capability >= 9.0, got {major}.{minor}"
    reason = _tma_status()
    if reason:
        return reason
    k = spec.x.features
    size = torch.empty((), dtype=spec.dtype).element_size()
    if (k * size) % 16:
        return f"in_features {k} x {size} bytes is not a multiple of 16 bytes (TMA row pitch)"
    return None


def make_backward(dgrad, wgrad):
    """A ``backward`` entry from ``dgrad(dy, sizes, weight) -> dx`` and ``wgrad(dy, x, sizes,
    groups, need_db=) -> (dw, db)``; outputs not asked for are empty tensors."""
    def backward(dy, x, group_sizes, weight, *, need_dx, need_dw, need_db):
        empty = dy.new_empty(0)
        dx = dgrad(dy, group_sizes, weight) if need_dx else empty
        dw, db = empty, empty
        if need_dw or need_db:
            dw, db = wgrad(dy, x, group_sizes, weight.shape[0], need_db=need_db)
            db = db if need_db else empty
            dw = dw if need_dw else empty
        return dx, dw, db

    return backward


def forward(x, group_sizes, weight, bias):
    return grouped_mm(x, group_sizes, weight, nk=True, bias=bias)


def forward_tma(x, group_sizes, weight, bias):
    return grouped_mm(x, group_sizes, weight, nk=True, bias=bias, use_tma=True)


backward = make_backward(lambda dy, sizes, w: grouped_mm(dy, sizes, w, nk=False), grouped_wgrad)
backward_tma = make_backward(lambda dy, sizes, w: grouped_mm(dy, sizes, w, nk=False, use_tma=True), grouped_wgrad)
