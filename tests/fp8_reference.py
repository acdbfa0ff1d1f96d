"""float64 references of the FP8 ops, written from the documentation of :mod:`opfuse.fp8`
(quantize each GEMM operand as the tables there say, dequantize, multiply in float64), shared by
the CPU and multi-process FP8 tests."""

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def pow2_floor(ratio):
    """The largest power of two <= ``ratio`` (float32, > 0; infinite for a subnormal amax), the
    exponent clamped to [-126, 126]."""
    _, exponent = torch.frexp(ratio.double())  # ratio = m * 2**exponent, m in [0.5, 1)
    exponent = torch.where(torch.isinf(ratio), torch.full_like(exponent, 127), exponent)
    return torch.pow(2.0, (exponent - 1).clamp(-126, 126).double()).float()


def fq(x, dtype, rowwise, amax=None, pow2=False):
    """The documented quantization, written out here: float64 value of quantize -> dequantize of 2-D
    ``x`` along its rows (float32 scales); ``amax`` overrides the tensor's; ``pow2``: the scale
    rounded down to a power of two."""
    x = x.float()
    if amax is None:
        if x.numel() == 0:
            return x.double()
        amax = x.abs().amax(-1, keepdim=True) if rowwise else x.abs().amax().reshape(1, 1)
    limit = {E4M3: 448.0, E5M2: 57344.0}[dtype]
    scale = torch.where(amax > 0, torch.full_like(amax, limit) / amax, torch.ones_like(amax))
    if pow2:
        scale = torch.where(amax > 0, pow2_floor(scale), torch.ones_like(amax))
    q = (x * scale).clamp(-limit, limit).to(dtype)
    return q.double() * (torch.ones_like(scale) / scale).double()


def linear_reference(x, w, b, dy, recipe):
    """float64 ``(y, dx, dW, db)`` of an FP8 linear with ``recipe`` (the table of opfuse.fp8.linear)."""
    rw, g, pow2 = recipe.rowwise, recipe.grad_dtype, recipe.pow2_weight_scales
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    xq = fq(x2, E4M3, rw)
    y = xq @ fq(w, E4M3, rw, pow2=pow2).t() + (b.double() if b is not None else 0)
    dyq = fq(dy2, g, rw)
    wt = fq(w, E4M3, False, pow2=pow2).t() if not rw else fq(w.t(), E4M3, True)
    dx = dyq @ wt.t()
    if recipe.fp8_wgrad:
        dyt = dyq.t() if not rw else fq(dyq.t(), g, True)
        xt = xq.t() if not rw else fq(xq.t(), E4M3, True)
        dw = dyt @ xt.t()
    else:
        dw = dy2.double().t() @ xq
    return y.reshape(*x.shape[:-1], w.shape[0]), dx.reshape(x.shape), dw, dy2.double().sum(0)


def grouped_reference(x, sizes, w, b, dy, recipe):
    """float64 ``(y, dx, dW, db)`` of the FP8 grouped GEMM (the table of opfuse.fp8.grouped)."""
    tokens, groups = x.shape[0], w.shape[0]
    ends = torch.cumsum(sizes.clamp(min=0), 0).clamp(max=tokens).tolist()
    starts = [0] + ends[:-1]
    valid = ends[-1]
    if recipe.rowwise:
        xq = fq(x, E4M3, True)
    else:  # one scale from the rows the groups own
        xq = fq(x, E4M3, False, amax=x[:valid].abs().amax().reshape(1, 1) if valid else torch.zeros(1, 1))
    wq = torch.stack([fq(w[g], E4M3, recipe.rowwise, pow2=recipe.pow2_weight_scales) for g in range(groups)])
    dyq = fq(dy, E4M3, True)
    wt = torch.stack([wq[g].t() if not recipe.rowwise else fq(w[g].t(), E4M3, True) for g in range(groups)])
    y, dx = torch.zeros(tokens, w.shape[1], dtype=torch.float64), torch.zeros(tokens, w.shape[2], dtype=torch.float64)
    dw, db = torch.zeros(w.shape, dtype=torch.float64), torch.zeros(w.shape[:2], dtype=torch.float64)
    for g, (s, e) in enumerate(zip(starts, ends)):
        y[s:e] = xq[s:e] @ wq[g].t() + b[g].double()
        dx[s:e] = dyq[s:e] @ wt[g].t()
        if recipe.fp8_wgrad:  # each operand's column scaled over the expert's tokens: rows of its transpose
            dw[g] = fq(dy[s:e].t(), E4M3, True) @ fq(x[s:e].t(), E4M3, True).t() if e > s else 0
        else:
            dw[g] = dy[s:e].double().t() @ x[s:e].double()
        db[g] = dy[s:e].double().sum(0)
    return y, dx, dw, db


def fused_and_unfused(block, x, r, dy, dh, recipe, **settings):
    """Run ``y, h = block(x, r)`` under ``recipe`` fused (with ``settings``: opfuse.config
    overrides) and unfused (the float32 emulation), backward from ``(dy, dh)``: ``(results, fusions)``,
    ``results`` two lists ``[y, h, dx, dr, *parameter grads]``, ``fusions`` ``{rule: impl}`` of the
    fused program."""
    import opfuse
    from opfuse import fp8

    results, fusions = [], {}
    for fuse in (True, False):
        xg, rg = x.clone().requires_grad_(), r.clone().requires_grad_()
        block.zero_grad(set_to_none=True)
        with opfuse.config.override(fuse=fuse, **(settings if fuse else {})), fp8.autocast(recipe=recipe):
            y, h = block(xg, rg)
            program = opfuse.compile(block, xg, rg)
        ((y.float() * dy.float()).sum() + (h.float() * dh.float()).sum()).backward()
        results.append([y, h, xg.grad, rg.grad] + [p.grad for p in block.parameters()])
        if fuse:
            fusions = {f.rule: f.impl for f in program.fusions}
        else:
            assert not program.fusions, [f.rule for f in program.fusions]
    return results, fusions
