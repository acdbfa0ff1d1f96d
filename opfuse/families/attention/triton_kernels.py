"""Triton kernels of decode attention over a key/value cache with fewer heads than the queries
(split over the cache's positions, flash-decoding style).

* :func:`partial_kernel`: program ``(b * Hk + h, s)`` attends the ``G`` query heads that share
  key/value head ``h`` of sequence ``b`` to split ``s`` of the cache's positions, with an online
  softmax, and writes the split's unnormalised output, running max and denominator (float32).
* :func:`combine_kernel`: program ``b * Hk + h`` merges the splits into the ``G`` heads' outputs.

Scores and sums are float32; a position the mask hides (False, or an additive -inf) weighs 0, and
a split whose positions are all hidden contributes nothing. Imported only where triton is.
"""

import triton
import triton.language as tl


@triton.jit
def partial_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, m_ptr, l_ptr,
                   stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
                   stride_mb, stride_ml, kv_heads, length, keys_per_split, splits, scale,
                   G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr):
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
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    first = split * keys_per_split
    last = tl.minimum(first + keys_per_split, length)
    start = first
    while start < last:  # a while loop: the interpreter's range() takes no tensor bounds
        offs_n = start + tl.arange(0, BLOCK_N)
        in_n = offs_n < last
        k = tl.load(k_base + offs_n[:, None].to(tl.int64) * stride_kl + offs_d[None, :],
                    mask=in_n[:, None] & in_d[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if MASK == 1:  # boolean: False hides the position
            keep = tl.load(mask_ptr + b.to(tl.int64) * stride_mb + offs_n.to(tl.int64) * stride_ml, mask=in_n,
                           other=0)
            s = tl.where((keep != 0)[None, :], s, float("-inf"))
        elif MASK == 2:  # additive
            bias = tl.load(mask_ptr + b.to(tl.int64) * stride_mb + offs_n.to(tl.int64) * stride_ml, mask=in_n,
                           other=0.0)
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
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        start += BLOCK_N
    row = (bh.to(tl.int64) * splits + split) * G_PAD
    tl.store(m_ptr + row + offs_g, m_i)
    tl.store(l_ptr + row + offs_g, l_i)
    tl.store(acc_ptr + (row + offs_g)[:, None] * BLOCK_D + offs_d[None, :], acc)


@triton.jit
def combine_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, splits, stride_ob, stride_oh, kv_heads,
                   G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   S_PAD: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // kv_heads
    h = bh % kv_heads
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, S_PAD)
    base = bh.to(tl.int64) * splits * G_PAD
    ms = tl.load(m_ptr + base + offs_s[:, None] * G_PAD + offs_g[None, :], mask=(offs_s < splits)[:, None],
                 other=float("-inf"))
    top = tl.max(ms, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    num = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    den = tl.zeros([G_PAD], tl.float32)
    s = 0
    while s < splits:
        row = base + s * G_PAD
        weight = tl.exp(tl.load(m_ptr + row + offs_g) - top)  # 0 for a split that saw nothing
        den += weight * tl.load(l_ptr + row + offs_g)
        num += weight[:, None] * tl.load(acc_ptr + (row + offs_g)[:, None] * BLOCK_D + offs_d[None, :])
        s += 1
    out = num / den[:, None]
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + (h * G + offs_g)[:, None].to(tl.int64) * stride_oh
             + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=(offs_g < G)[:, None] & (offs_d < D)[None, :])
