"""Persistent Triton kernels for grouped GEMMs on Hopper and newer (TMA operand loads).

Imported only on a GPU path (or under ``TRITON_INTERPRET=1``): importing it imports triton.

Forward and dgrad take two launches, both with static grids, so CUDA graphs replay them with new
device-side group sizes: ``grouped_tile_map_kernel`` (one program) lists the m-tiles of every row
range of :func:`.triton_kernels._group_rows` (the ``G`` groups, then the tail past
``sum(sizes)``), ``ceil(rows / BM)`` each; ``grouped_mm_persistent_kernel`` runs a fixed number of
programs (a few per SM) that walk the work items, m-tiles times n-tiles. A tail item runs no K
iterations and stores zeros.

``grouped_wgrad_tma_kernel`` (weight gradient) runs one program per ``(group, n-tile, k-tile)``
of ``dW[g]``, accumulating ``dy_g^T x_g`` over the group's rows in float32. Its operands are
loaded through descriptors built on the device for exactly the group's rows, so TMA zero-fills
what lies past them (another group's tokens, or uninitialised tail rows) and no mask is needed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_kernels import _group_rows, _pick, _wgrad_tile

__all__ = ["grouped_tile_map_kernel", "grouped_mm_persistent_kernel", "grouped_wgrad_tma_kernel"]


@triton.jit
def grouped_tile_map_kernel(Sizes, Map, T, G, BM: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr):
    """The m-tiles of a grouped GEMM, for :func:`grouped_mm_persistent_kernel` (one program).

    ``Map[0]`` = the number of m-tiles; ``Map[1 + 3 i : 4 + 3 i]`` = ``(group, first row, end
    row)`` of m-tile ``i``, group-major, each group's rows (and the tail past ``sum(sizes)``, as
    group ``G``) tiled by ``BM`` separately. At most ``(T + (G + 1) * (BM - 1)) // BM`` m-tiles.
    """
    lanes, starts, ends = _group_rows(Sizes, G, T, GP)
    # Row indices fit in int32 (the launcher's check: T < 2**31).
    starts, ends = starts.to(tl.int32), ends.to(tl.int32)
    m_tiles = (ends - starts + BM - 1) // BM
    tiles_end = tl.cumsum(m_tiles, 0)
    total = tl.sum(m_tiles, axis=0)
    tl.store(Map, total)
    for i0 in range(0, total, BLOCK):
        idx = i0 + tl.arange(0, BLOCK)
        # The group of m-tile idx: the number of lanes whose tiles end at or before it.
        g = tl.sum((tiles_end[None, :] <= idx[:, None]).to(tl.int32), axis=1)
        hit = lanes[None, :] == g[:, None]
        first = tl.sum(tl.where(hit, (tiles_end - m_tiles)[None, :], 0), axis=1)
        start = tl.sum(tl.where(hit, starts[None, :], 0), axis=1)
        end = tl.sum(tl.where(hit, ends[None, :], 0), axis=1)
        ok = idx < total
        entry = Map + 1 + 3 * idx
        tl.store(entry, g, mask=ok)
        tl.store(entry + 1, start + (idx - first) * BM, mask=ok)
        tl.store(entry + 2, end, mask=ok)


@triton.jit
def grouped_mm_persistent_kernel(
    a_desc, b_desc, C, Bias, Map,
    N, KC, G, stride_cm,
    HAS_BIAS: tl.constexpr, B_NK: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    """``C[rows of g] = A[rows of g] @ B_g (+ Bias[g])`` for every group; ``C[tail] = 0``.

    ``Map`` is :func:`grouped_tile_map_kernel`'s list of m-tiles; the work items are the m-tiles
    times the n-tiles, in super-rows of ``GROUP_M`` m-tiles that sweep all n-tiles (L2 reuse),
    dealt round-robin to the programs. The loop body reads its tile from ``Map`` with scalar
    loads: Triton's Hopper warp specialisation takes no reductions inside the partitioned loop.

    ``a_desc`` describes ``A [T, KC]`` in ``[BM, BK]`` boxes: a tile's rows past its group's end
    are the next group's (or zero-filled past ``T``) and only feed output rows the masked store
    drops. With ``B_NK`` (forward) ``b_desc`` describes the weight as ``[G * N, KC]`` in ``[BN, BK]``
    boxes: rows past ``N`` are the next group's and only feed masked output columns. Without it
    (dgrad, ``B_g [KC, N]``) ``b_desc`` describes the weight as ``[G, KC, N]`` in ``[1, BK, BN]``
    boxes, so the contraction's tail inside one group is zero-filled by TMA instead of reading the
    next group.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    total_m = tl.load(Map)
    k_tiles = tl.cdiv(KC, BK)
    rm = tl.arange(0, BM)
    rn_base = tl.arange(0, BN)
    width = GROUP_M * num_n

    for item in tl.range(pid, total_m * num_n, tl.num_programs(0), warp_specialize=WARP_SPECIALIZE):
        first_m = (item // width) * GROUP_M
        rows_here = tl.minimum(total_m - first_m, GROUP_M)
        mt = first_m + (item % width) % rows_here
        n0 = ((item % width) // rows_here) * BN
        g = tl.load(Map + 1 + 3 * mt)
        m0 = tl.load(Map + 2 + 3 * mt)
        row_end = tl.load(Map + 3 + 3 * mt)
        in_group = g < G

        acc = tl.zeros((BM, BN), dtype=tl.float32)
        # The tail (g == G) runs no K iterations: its tile stays zero.
        for kt in range(0, tl.where(in_group, k_tiles, 0)):
            k0 = kt * BK
            a = a_desc.load([m0, k0])
            if B_NK:
                b = b_desc.load([g * N + n0, k0]).T
            else:
                b = b_desc.load([g, k0, n0]).reshape(BK, BN)
            acc = tl.dot(a, b, acc)

        rn = n0 + rn_base
        n_ok = rn < N
        if HAS_BIAS:
            bias = tl.load(Bias + g.to(tl.int64) * N + rn, mask=n_ok & in_group, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        c_ptrs = C + m0.to(tl.int64) * stride_cm + (rm[:, None] * stride_cm + rn[None, :])
        c_mask = ((m0 + rm) < row_end)[:, None] & n_ok[None, :]
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=c_mask)


@triton.jit
def grouped_wgrad_tma_kernel(
    DY, X, DW, DB, Sizes,
    T, N, K, G,
    HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, GP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """``DW[g] = DY[rows of g].T @ X[rows of g]`` and ``DB[g] = sum(DY[rows of g])``.

    ``DY [T, N]`` and ``X [T, K]`` are row-major with 16-byte aligned rows; one program per
    ``(g, n-tile, k-tile)`` (a static grid); a group without rows runs no iterations and stores
    zeros. The device-side descriptors start at the group's first row and end at its last, so the
    ``BT``-row steps need no masks. (Device-side descriptors need a global scratch allocation per
    program: the launcher sets triton's allocator for the launch.)
    """
    g, pid_n, pid_k = _wgrad_tile(N, K, BN, BK)
    n0 = pid_n * BN
    k0 = pid_k * BK

    lanes, starts, ends = _group_rows(Sizes, G, T, GP)
    row_start = _pick(lanes, starts, g)
    count = (_pick(lanes, ends, g) - row_start).to(tl.int32)

    acc = tl.zeros((BN, BK), dtype=tl.float32)
    db = tl.zeros((BN,), dtype=tl.float32)
    if count > 0:
        # A descriptor's shape must be positive, so empty groups skip building one.
        dy_desc = tl.make_tensor_descriptor(DY + row_start * N, shape=[count, N], strides=[N, 1],
                                            block_shape=[BT, BN])
        x_desc = tl.make_tensor_descriptor(X + row_start * K, shape=[count, K], strides=[K, 1],
                                           block_shape=[BT, BK])
        for t0 in tl.range(0, count, BT, num_stages=NUM_STAGES):
            dy = dy_desc.load([t0, n0])
            xv = x_desc.load([t0, k0])
            acc = tl.dot(dy.T, xv, acc)
            if HAS_BIAS:
                db += tl.sum(dy.to(tl.float32), axis=0)

    rn = n0 + tl.arange(0, BN)
    rk = k0 + tl.arange(0, BK)
    n_ok = rn < N
    dw_ptrs = DW + g.to(tl.int64) * N * K + (rn[:, None] * K + rk[None, :])
    tl.store(dw_ptrs, acc.to(DW.dtype.element_ty), mask=n_ok[:, None] & (rk < K)[None, :])
    if HAS_BIAS:
        if pid_k == 0:
            tl.store(DB + g.to(tl.int64) * N + rn, db.to(DB.dtype.element_ty), mask=n_ok)
