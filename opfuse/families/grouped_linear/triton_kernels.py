"""Triton kernels for grouped GEMMs whose group sizes stay on the device.

Imported only on a GPU path (or under ``TRITON_INTERPRET=1``): importing it imports triton.

Every program derives its group from ``Sizes`` itself (a vector load of the G counts, two prefix
sums), so no kernel needs host-side offsets and the launch grids depend only on static shapes:
CUDA graphs replay them with new sizes written on the device.

Row ranges, for counts clamped to ``[0, inf)`` and ends clamped to ``T`` (so bad counts can never
address memory outside x)::

    end_g = min(c_0 + ... + c_g, T),   start_g = min(c_0 + ... + c_{g-1}, T)

and a pseudo-group ``G`` covering the tail ``[end_{G-1}, T)``, whose output rows are written as
zeros. ``grouped_mm_kernel`` tiles each group's rows separately (``BM`` rows per tile, the last one
partial), so the number of m-tiles is at most ``(T + (G + 1) * (BM - 1)) // BM`` whatever the
sizes: the grid is that bound times the n-tiles, and programs past the real count exit at once.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["grouped_mm_kernel", "grouped_wgrad_kernel", "zero_tail_rows_kernel", "zero_empty_groups_kernel"]


@triton.jit
def _group_rows(Sizes, G, T, GP: tl.constexpr):
    """Row ranges ``[starts, ends)`` (int64 vectors over ``GP > G`` lanes; lane ``G`` = tail)."""
    lanes = tl.arange(0, GP)
    counts = tl.load(Sizes + lanes, mask=lanes < G, other=0).to(tl.int64)
    counts = tl.maximum(counts, 0)
    inclusive = tl.cumsum(counts, 0)
    starts = tl.minimum(inclusive - counts, T)
    ends = tl.minimum(inclusive, T)
    ends = tl.where(lanes == G, T, ends)
    return lanes, starts, ends


@triton.jit
def _pick(lanes, values, index):
    """``values[index]`` of a lane vector, as a scalar."""
    return tl.sum(tl.where(lanes == index, values, 0), axis=0)


@triton.jit
def _wgrad_tile(N, K, BN: tl.constexpr, BK: tl.constexpr):
    """``(g, pid_n, pid_k)`` of this program of a weight-gradient grid over ``(g, n-tile,
    k-tile)``, k-tiles fastest (programs running together share the group's dy columns)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    num_k = tl.cdiv(K, BK)
    g = pid // (num_n * num_k)
    rest = pid % (num_n * num_k)
    return g, rest // num_k, rest % num_k


@triton.jit
def grouped_mm_kernel(
    a_src, b_src, C, Bias, Sizes,
    T, N, KC, G, M_TILES,
    stride_am, stride_bg, stride_bk, stride_bn, stride_cm,
    HAS_BIAS: tl.constexpr, A_TMA: tl.constexpr, B_TMA: tl.constexpr, B_NK: tl.constexpr,
    EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, GP: tl.constexpr, PRECISION: tl.constexpr,
):
    """``C[rows of g] = A[rows of g] @ B_g (+ Bias[g])``; ``C[tail] = 0``.

    ``A [T, KC]`` row-major. ``B_g [KC, N]`` at ``b_src + g * stride_bg + k * stride_bk + n *
    stride_bn`` (pointer mode). TMA mode: ``a_src`` describes ``A`` in ``[BM, BK]`` boxes; with
    ``B_NK`` (B_g stored ``[N, KC]``, the forward weight) ``b_src`` describes the ``[G * N, KC]``
    weight in ``[BN, BK]`` boxes, else (B_g stored ``[KC, N]``, dgrad) the ``[G * KC, N]`` weight in
    ``[BK, BN]`` boxes, which needs ``EVEN_K`` so a box never straddles two groups.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BN)
    # Super-rows of GROUP_M m-tiles sweep all n-tiles together, so the A rows and the B_g columns
    # a wave of programs touches stay in L2.
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    rows_here = tl.minimum(M_TILES - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows_here
    pid_n = (pid % width) // rows_here

    lanes, starts, ends = _group_rows(Sizes, G, T, GP)
    tiles = (ends - starts + BM - 1) // BM
    tiles_incl = tl.cumsum(tiles, 0)
    if pid_m >= tl.max(tiles_incl, axis=0):
        return
    g = tl.sum((tiles_incl <= pid_m).to(tl.int32), axis=0)
    row_end = _pick(lanes, ends, g)
    m0 = _pick(lanes, starts, g) + (pid_m - _pick(lanes, tiles_incl - tiles, g)) * BM

    rm = tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    row_ok = (m0 + rm) < row_end
    n_ok = rn < N
    c_ptrs = C + m0 * stride_cm + (rm[:, None] * stride_cm + rn[None, :])
    c_mask = row_ok[:, None] & n_ok[None, :]
    if g == G:
        # Tail past sum(group_sizes): defined zeros instead of whatever the buffer held.
        tl.store(c_ptrs, tl.zeros((BM, BN), dtype=C.dtype.element_ty), mask=c_mask)
        return

    rk = tl.arange(0, BK)
    if not A_TMA:
        a_ptrs = a_src + m0 * stride_am + (rm[:, None] * stride_am + rk[None, :])
    if not B_TMA:
        b_ptrs = b_src + g.to(tl.int64) * stride_bg + (rk[:, None] * stride_bk + rn[None, :] * stride_bn)
    a_row = m0.to(tl.int32)
    if B_NK:
        b_row = g * N + pid_n * BN
    else:
        b_row = g * KC

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kt in range(0, tl.cdiv(KC, BK)):
        k0 = kt * BK
        if A_TMA:
            # Rows past this group's end belong to the next group (or are zero-filled past T);
            # they only feed output rows that the masked store drops.
            a = a_src.load([a_row, k0])
        else:
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & (rk[None, :] < KC - k0), other=0.0)
            a_ptrs += BK
        if B_TMA:
            if B_NK:
                # Columns past KC are zero-filled; rows past N (next group) only feed masked columns.
                b = b_src.load([b_row, k0]).T
            else:
                b = b_src.load([b_row + k0, pid_n * BN])
        else:
            if EVEN_K:
                b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                b = tl.load(b_ptrs, mask=(rk[:, None] < KC - k0) & n_ok[None, :], other=0.0)
            b_ptrs += BK * stride_bk
        acc = tl.dot(a, b, acc, input_precision=PRECISION)

    if HAS_BIAS:
        bias = tl.load(Bias + g.to(tl.int64) * N + rn, mask=n_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=c_mask)


@triton.jit
def grouped_wgrad_kernel(
    DY, X, DW, DB, Sizes,
    T, N, K, G,
    stride_dy, stride_x,
    HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    GP: tl.constexpr, PRECISION: tl.constexpr,
):
    """``DW[g] = DY[rows of g].T @ X[rows of g]`` and ``DB[g] = sum(DY[rows of g])``.

    One program per ``(g, n-tile, k-tile)``: a static grid. A group without rows runs its loop
    zero times and stores zeros, so empty groups never keep stale gradients.
    """
    g, pid_n, pid_k = _wgrad_tile(N, K, BN, BK)
    lanes, starts, ends = _group_rows(Sizes, G, T, GP)
    row_start = _pick(lanes, starts, g)
    count = (_pick(lanes, ends, g) - row_start).to(tl.int32)

    rt = tl.arange(0, BT)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_k * BK + tl.arange(0, BK)
    n_ok = rn < N
    k_ok = rk < K
    dy_ptrs = DY + row_start * stride_dy + (rt[:, None] * stride_dy + rn[None, :])
    x_ptrs = X + row_start * stride_x + (rt[:, None] * stride_x + rk[None, :])
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    db = tl.zeros((BN,), dtype=tl.float32)
    for t0 in range(0, count, BT):
        t_ok = rt < count - t0
        dy = tl.load(dy_ptrs, mask=t_ok[:, None] & n_ok[None, :], other=0.0)
        xv = tl.load(x_ptrs, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(tl.trans(dy), xv, acc, input_precision=PRECISION)
        if HAS_BIAS:
            db += tl.sum(dy.to(tl.float32), axis=0)
        dy_ptrs += BT * stride_dy
        x_ptrs += BT * stride_x

    dw_ptrs = DW + g.to(tl.int64) * N * K + (rn[:, None] * K + rk[None, :])
    tl.store(dw_ptrs, acc.to(DW.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])
    if HAS_BIAS:
        if pid_k == 0:
            tl.store(DB + g.to(tl.int64) * N + rn, db.to(DB.dtype.element_ty), mask=n_ok)


@triton.jit
def zero_tail_rows_kernel(C, Sizes, G, T, N, stride_cm, BM: tl.constexpr, BN: tl.constexpr, GP: tl.constexpr):
    """Zero ``C[sum(sizes):T]`` (what ``torch._grouped_mm`` leaves uninitialised). One program per
    ``BM`` rows; programs wholly below the sum exit after reading the sizes."""
    pid = tl.program_id(0)
    lanes, starts, ends = _group_rows(Sizes, G, T, GP)
    total = _pick(lanes, starts, G)
    m0 = pid.to(tl.int64) * BM
    if m0 + BM <= total:
        return
    rm = m0 + tl.arange(0, BM)
    row_ok = (rm >= total) & (rm < T)
    for n0 in range(0, N, BN):
        rn = n0 + tl.arange(0, BN)
        ptrs = C + rm[:, None] * stride_cm + rn[None, :]
        tl.store(ptrs, tl.zeros((BM, BN), dtype=C.dtype.element_ty), mask=row_ok[:, None] & (rn < N)[None, :])


@triton.jit
def zero_empty_groups_kernel(DW, Sizes, G, T, NK, BLOCK: tl.constexpr, GP: tl.constexpr):
    """Zero ``DW[g]`` (``NK`` elements) for every group without rows. Grid ``(G, P)``: the ``P``
    programs of an empty group sweep its gradient; the others exit after reading the sizes."""
    g = tl.program_id(0)
    pid = tl.program_id(1)
    lanes, starts, ends = _group_rows(Sizes, G, T, GP)
    if _pick(lanes, ends - starts, g) > 0:
        return
    base = DW + g.to(tl.int64) * NK
    for offset in range(pid * BLOCK, NK, tl.num_programs(1) * BLOCK):
        idx = offset + tl.arange(0, BLOCK)
        tl.store(base + idx, tl.zeros((BLOCK,), dtype=DW.dtype.element_ty), mask=idx < NK)
