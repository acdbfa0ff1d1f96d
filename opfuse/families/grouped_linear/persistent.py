"""``triton_persistent``: opfuse's persistent grouped GEMM for Hopper and newer (Triton, TMA loads).

* Forward and dgrad: one persistent kernel (:mod:`.persistent_kernels`) over the work items
  ``(group, m-tile, n-tile)``, a few programs per SM, operands loaded by TMA through host tensor
  descriptors over the packed ``x`` / ``dy`` and the weight, a pipelined K loop and, for the
  large tiles, Triton's automatic warp specialisation (TMA producer + two MMA consumers).
* Weight gradient: one program per ``(group, n-tile, k-tile)`` of ``dW[g]`` accumulating over the
  group's rows in float32, operands loaded by TMA through descriptors built on the device for the
  group's rows.
* bfloat16/float16, rows 16-byte aligned (``K`` and ``N`` multiples of 8), sm90+; group sizes
  stay on the device (no host sync, CUDA-graph capturable), empty groups get zero ``dW``, rows
  past ``sum(group_sizes)`` get zeros, bias fused.

Tiles: measured per GPU and size class in :data:`.tuning.PERSISTENT_TILES`, else
:func:`default_tiles`. ``triton`` is imported inside the functions only.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools

import torch
from torch import Tensor

from . import tuning
from .triton_impl import (_INT32_MAX, _next_pow2, _tma_status, make_backward, m_tile_bound,
                          triton_gpu_reason, wgrad_outputs)

__all__ = ["NAME", "default_tiles", "CANDIDATES", "tiles", "WgradTiles", "WGRAD_TILES", "grouped_mm_persistent",
           "grouped_wgrad_tma", "check", "forward", "backward"]

NAME = "triton_persistent"
_DTYPES = (torch.bfloat16, torch.float16)
# Programs of the persistent grid when the kernels run on the CPU (TRITON_INTERPRET=1): a few, so
# that every program walks several work items.
_INTERPRETER_PROGRAMS = 3
# Groups the persistent kernels take: the tile-map kernel compares m-tiles with all group lanes.
_MAX_PERSISTENT_GROUPS = 1023


def _map_block(gp: int) -> int:
    """m-tiles the tile-map kernel handles per step (``BLOCK x GP`` comparisons)."""
    return max(16, 2048 // gp)


def _map_warps(gp: int) -> int:
    return 4 if gp <= 128 else 8


def default_tiles(cls: str) -> tuning.Tiles:
    """Tiles before measurement, per size class (sm90 compile: no spills, shared memory in budget).

    ``large_m``: 128x256x64 over two warpgroups (8 warps, 64x256 each), three stages.
    ``small_m``: 64x128x64, two programs per SM. ``decode``: the weights stream through 32x64x128
    tiles (every group's rows in one m-tile up to 32 rows, so each weight tile is read once), two
    programs per SM and four stages keep ~128 KiB of loads in flight per SM.

    No tile warp-specialises the work loop: on H100 with Triton 3.6 the warp-specialised kernel
    did not finish (docs/PERF_NOTES.md, grouped GEMM, session 4).
    """
    if cls == "decode":
        return tuning.Tiles(32, 64, 128, num_warps=4, num_stages=4, programs_per_sm=2)
    if cls == "small_m":
        return tuning.Tiles(64, 128, 64, num_warps=4, num_stages=4, programs_per_sm=2)
    return tuning.Tiles(128, 256, 64, num_warps=8, num_stages=3)


#: Tiles bench/grouped_tune.py times per size class besides :func:`default_tiles` (all compile for
#: sm90 without spills, and ``programs_per_sm`` of them fit in an SM's shared memory:
#: tools/grouped_compile_report.py).
CANDIDATES: dict[str, tuple[tuning.Tiles, ...]] = {
    "decode": (
        tuning.Tiles(16, 64, 128, num_warps=4, num_stages=4, programs_per_sm=2),
        tuning.Tiles(32, 64, 128, num_warps=4, num_stages=3, programs_per_sm=3),
        tuning.Tiles(32, 128, 128, num_warps=4, num_stages=3, programs_per_sm=1),
        tuning.Tiles(64, 64, 128, num_warps=4, num_stages=3, programs_per_sm=2),
    ),
    "small_m": (
        tuning.Tiles(64, 256, 64, num_warps=4, num_stages=3),
        tuning.Tiles(128, 128, 64, num_warps=4, num_stages=4),
        tuning.Tiles(128, 256, 64, num_warps=8, num_stages=3),
    ),
    "large_m": (
        tuning.Tiles(64, 256, 64, num_warps=4, num_stages=3),
        tuning.Tiles(128, 128, 64, num_warps=4, num_stages=4),
        tuning.Tiles(128, 128, 64, num_warps=8, num_stages=3),
    ),
}


def tiles(device: torch.device, tokens: int, groups: int, k: int, n: int) -> tuning.Tiles:
    """The tiles of a ``[tokens, *]`` grouped GEMM over ``groups`` ``[n, k]`` weights: measured
    for this GPU if :data:`.tuning.PERSISTENT_TILES` has them, else :func:`default_tiles`."""
    cls = tuning.size_class(tokens, groups, k, n)
    return tuning.tiles_for(device, cls) or default_tiles(cls)


@dataclasses.dataclass(frozen=True)
class WgradTiles:
    """Tiles of the weight-gradient kernel: ``BN x BK`` of ``dW[g]``, ``BT`` rows per step."""

    bt: int = 64
    bn: int = 128
    bk: int = 128
    num_warps: int = 8
    num_stages: int = 3


#: 128x128 fp32 accumulator over two warpgroups (64 registers a thread), 64-row steps of dy and
#: x (32 KiB a stage, three stages).
WGRAD_TILES = WgradTiles()


def _fit(block: int, size: int) -> int:
    return max(16, min(block, _next_pow2(size)))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(device: torch.device, per_sm: int) -> int:
    if device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    return _sm_count(torch.cuda.current_device() if device.index is None else device.index) * per_sm


def _aligned(t: Tensor) -> Tensor:
    # TMA needs 16-byte aligned base addresses; views into larger buffers may be offset.
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def grouped_mm_persistent(a: Tensor, sizes: Tensor, weight: Tensor, *, nk: bool, bias: Tensor | None = None,
                          out: Tensor | None = None, config: tuning.Tiles | None = None) -> Tensor:
    """Per group ``g``: ``out[rows of g] = a[rows of g] @ (weight[g].T if nk else weight[g]) (+ bias[g])``.

    ``a [T, KC]``; ``weight [G, N, KC]`` (``nk``, the forward) or ``[G, KC, N]`` (dgrad; the
    forward's ``[G, N, K]`` weight read as is); ``sizes [G]`` int32/int64 on the device; ``out
    [T, N]`` (allocated if ``None``; every element written, rows past ``sum(sizes)`` with zeros).
    ``config`` overrides the tiles (the tuning script).
    """
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .persistent_kernels import grouped_mm_persistent_kernel, grouped_tile_map_kernel

    a, weight = _aligned(a), _aligned(weight)
    tokens, k_contract = a.shape
    groups = weight.shape[0]
    n_out = weight.shape[1] if nk else weight.shape[2]
    if (weight.shape[2] if nk else weight.shape[1]) != k_contract:
        raise ValueError(f"grouped_mm_persistent: a {list(a.shape)} and weight {list(weight.shape)} (nk={nk}) "
                         "do not chain")
    if out is None:
        out = a.new_empty(tokens, n_out)
    if tokens == 0:
        return out
    # The size class and the measured tiles belong to the forward shape ([N, K] weights).
    fwd_n, fwd_k = (n_out, k_contract) if nk else (k_contract, n_out)
    cfg = config or tiles(a.device, tokens, groups, fwd_k, fwd_n)
    bm, bn, bk = cfg.bm, _fit(cfg.bn, n_out), _fit(cfg.bk, k_contract)
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    if nk:
        b_desc = TensorDescriptor.from_tensor(weight.view(groups * n_out, k_contract), [bn, bk])
    else:
        b_desc = TensorDescriptor.from_tensor(weight, [1, bk, bn])
    m_tiles = m_tile_bound(tokens, groups, bm)
    gp = _next_pow2(groups + 1)
    tile_map = torch.empty(1 + 3 * m_tiles, dtype=torch.int32, device=a.device)
    grouped_tile_map_kernel[(1,)](sizes, tile_map, tokens, groups, BM=bm, GP=gp, BLOCK=_map_block(gp),
                                  num_warps=_map_warps(gp))
    grid = (max(1, min(m_tiles * triton.cdiv(n_out, bn), _programs(a.device, cfg.programs_per_sm))),)
    grouped_mm_persistent_kernel[grid](
        a_desc, b_desc, out, bias if bias is not None else out, tile_map,
        n_out, k_contract, groups, out.stride(0),
        HAS_BIAS=bias is not None, B_NK=nk, BM=bm, BN=bn, BK=bk, GROUP_M=cfg.group_m,
        WARP_SPECIALIZE=cfg.warp_specialize, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def _launch_with_scratch(device: torch.device, launch) -> None:
    """Run ``launch()`` with triton's allocator set to torch's for this launch only (the
    allocator is a context variable: setting it in a copied context leaves the caller's).

    The kernel builds its descriptors on the device, in global memory (128 bytes each per
    program) taken from torch's caching allocator on the current stream, so CUDA-graph capture
    keeps it in the graph's pool."""
    import triton

    def scratch(size: int, alignment: int, stream) -> Tensor:
        return torch.empty(size, dtype=torch.int8, device=device)

    def run():
        triton.set_allocator(scratch)
        launch()

    contextvars.copy_context().run(run)


def grouped_wgrad_tma(dy: Tensor, x: Tensor, sizes: Tensor, groups: int, *, need_db: bool,
                      dw: Tensor | None = None, db: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """``dw[g] = dy[rows of g].T @ x[rows of g]`` (``[G, N, K]``) and, with ``need_db``,
    ``db[g] = dy[rows of g].sum(0)`` (``[G, N]``); zeros for groups without rows."""
    import triton

    from .persistent_kernels import grouped_wgrad_tma_kernel

    dy, x = _aligned(dy), _aligned(x)
    tokens, n = dy.shape
    k = x.shape[1]
    dw, db = wgrad_outputs(dy, groups, k, need_db, dw, db)
    if tokens == 0:
        return dw, db
    cfg = WGRAD_TILES
    bn, bk = _fit(cfg.bn, n), _fit(cfg.bk, k)
    grid = (groups * triton.cdiv(n, bn) * triton.cdiv(k, bk),)

    def launch():
        grouped_wgrad_tma_kernel[grid](
            dy, x, dw, db if need_db else dw, sizes, tokens, n, k, groups,
            HAS_BIAS=need_db, BN=bn, BK=bk, BT=cfg.bt, GP=_next_pow2(groups + 1), NUM_STAGES=cfg.num_stages,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    _launch_with_scratch(dy.device, launch)
    return dw, db


# Dispatch-table entry -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _device_descriptor_status() -> str | None:
    import triton.language as tl

    if not hasattr(tl, "make_tensor_descriptor"):
        return "this triton cannot build tensor descriptors on the device (tl.make_tensor_descriptor)"
    return None


def check(spec) -> str | None:
    """Capability: CUDA sm90+, triton with host and device tensor descriptors, bfloat16/float16,
    16-byte rows of ``x``, the weight and ``dy`` (``K`` and ``N`` multiples of 8)."""
    reason = triton_gpu_reason(spec, _DTYPES, 9)
    if reason:
        return reason
    reason = _tma_status() or _device_descriptor_status()
    if reason:
        return reason
    weight = spec.inputs["weight"]
    groups, n, k = weight.shape
    if groups > _MAX_PERSISTENT_GROUPS:
        return f"{groups} groups (at most {_MAX_PERSISTENT_GROUPS})"
    size = weight.dtype.itemsize
    if (k * size) % 16 or (n * size) % 16:
        return (f"in_features {k} / out_features {n} x {size} bytes: rows must be multiples of 16 bytes "
                f"(TMA row pitch)")
    if spec.x.shape[0] > _INT32_MAX or groups * n > _INT32_MAX:
        return f"{spec.x.shape[0]} rows / {groups * n} weight rows exceed TMA's 32-bit coordinates"
    return None


def forward(x, group_sizes, weight, bias):
    return grouped_mm_persistent(x, group_sizes, weight, nk=True, bias=bias)


backward = make_backward(lambda dy, sizes, w: grouped_mm_persistent(dy, sizes, w, nk=False), grouped_wgrad_tma)
