"""Triton kernels of decode attention over a key/value cache with fewer heads than the queries
(split over the cache's positions, flash-decoding style).

* :func:`partial_kernel`: program ``(b * Hk + h, s)`` attends the ``G`` query heads that share
  key/value head ``h`` of sequence ``b`` to split ``s`` of the cache's positions, with an online
  softmax over ``steps`` tiles of ``BLOCK_N`` positions (a loop Triton software-pipelines: the
  next tile's loads in flight under this one's math), and writes the split's unnormalised output,
  running max and denominator (float32).
* :func:`combine_kernel`: program ``(b * Hk + h, g)`` merges the splits of query head ``g`` of the
  group, ``S_BLOCK`` splits per load (one memory round trip for up to ``S_BLOCK`` splits rather
  than one per split: the splits are many exactly when the programs are few).

Scores and sums are float32; a position the mask hides (False, or an additive -inf) weighs 0, and
a split whose positions are all hidden contributes nothing. Imported only where triton is.
"""

import triton
import triton.language as tl


@triton.jit
def _attend_tile(q, k_base, v_base, mask_base, offs_n, last, offs_d, in_d, stride_kl, stride_vl, stride_ml, scale,
                 m_i, l_i, acc, MASK: tl.constexpr, IEEE: tl.constexpr):
    """One tile of positions ``offs_n`` (those from ``last`` on are not this split's) into the online
    softmax state ``(m_i, l_i, acc)``."""
    in_n = offs_n < last
    k = tl.load(k_base + offs_n[:, None].to(tl.int64) * stride_kl + offs_d[None, :],
                mask=in_n[:, None] & in_d[None, :], other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    if MASK == 1:  # boolean: False hides the position
        keep = tl.load(mask_base + offs_n.to(tl.int64) * stride_ml, mask=in_n, other=0)
        s = tl.where((keep != 0)[None, :], s, float("-inf"))
    elif MASK == 2:  # additive
        bias = tl.load(mask_base + offs_n.to(tl.int64) * stride_ml, mask=in_n, other=0.0)
        s = s + bias.to(tl.float32)[None, :]
    s = tl.where(in_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN from -inf - -inf
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + offs_n[:, None].to(tl.int64) * stride_vl + offs_d[None, :],
                mask=in_n[:, None] & in_d[None, :], other=0.0)
    if IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def partial_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, m_ptr, l_ptr,
                   stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
                   stride_mb, stride_ml, kv_heads, length, keys_per_split, steps, splits, scale,
                   G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr, STAGES: tl.constexpr,
                   PIPELINED: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // kv_heads
    h = bh % kv_heads
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    in_g = offs_g < G
    in_d = offs_d < D
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (h * G + offs_g)[:, None].to(tl.int64) * stride_qh
                + offs_d[None, :], mask=in_g[:, None] & in_d[None, :], other=0.0)
    k_base = k_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = v_ptr + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    mask_base = mask_ptr + b.to(tl.int64) * stride_mb
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    first = split * keys_per_split
    last = tl.minimum(first + keys_per_split, length)
    if PIPELINED:  # a host-side trip count (the last split masks its tail), software-pipelined
        for step in tl.range(0, steps, num_stages=STAGES):
            m_i, l_i, acc = _attend_tile(q, k_base, v_base, mask_base, first + step * BLOCK_N + tl.arange(0, BLOCK_N),
                                         last, offs_d, in_d, stride_kl, stride_vl, stride_ml, scale, m_i, l_i, acc,
                                         MASK, IEEE)
    else:  # Triton's CPU interpreter, whose range() takes no runtime bounds
        start = first
        while start < last:
            m_i, l_i, acc = _attend_tile(q, k_base, v_base, mask_base, start + tl.arange(0, BLOCK_N), last, offs_d,
                                         in_d, stride_kl, stride_vl, stride_ml, scale, m_i, l_i, acc, MASK, IEEE)
            start += BLOCK_N
    row = (bh.to(tl.int64) * splits + split) * G_PAD
    tl.store(m_ptr + row + offs_g, m_i)
    tl.store(l_ptr + row + offs_g, l_i)
    tl.store(acc_ptr + (row + offs_g)[:, None] * BLOCK_D + offs_d[None, :], acc)


@triton.jit
def combine_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, splits, stride_ob, stride_oh, kv_heads,
                   G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   S_BLOCK: tl.constexpr):
    bh = tl.program_id(0)
    g = tl.program_id(1)
    b = bh // kv_heads
    h = bh % kv_heads
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, S_BLOCK)
    base = bh.to(tl.int64) * splits * G_PAD + g  # split s of this head: row base + s * G_PAD
    top = tl.full([S_BLOCK], float("-inf"), tl.float32)
    first = 0
    while first < splits:  # while loops: the interpreter's range() takes no runtime bounds
        offs = first + offs_s
        top = tl.maximum(top, tl.load(m_ptr + base + offs.to(tl.int64) * G_PAD, mask=offs < splits,
                                      other=float("-inf")))
        first += S_BLOCK
    peak = tl.max(top, axis=0)
    peak = tl.where(peak == float("-inf"), 0.0, peak)
    num = tl.zeros([BLOCK_D], tl.float32)
    den = tl.zeros([S_BLOCK], tl.float32)
    first = 0
    while first < splits:
        offs = first + offs_s
        valid = offs < splits
        rows = base + offs.to(tl.int64) * G_PAD
        weight = tl.exp(tl.load(m_ptr + rows, mask=valid, other=float("-inf")) - peak)  # 0: a split that saw nothing
        den += weight * tl.load(l_ptr + rows, mask=valid, other=0.0)
        part = tl.load(acc_ptr + rows[:, None] * BLOCK_D + offs_d[None, :], mask=valid[:, None], other=0.0)
        num += tl.sum(weight[:, None] * part, axis=0)
        first += S_BLOCK
    out = num / tl.sum(den, axis=0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + (h * G + g).to(tl.int64) * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < D)
