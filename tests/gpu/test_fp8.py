"""FP8 on one GPU: the Triton quantizers against :mod:`opfuse.fp8.numerics` (bit for bit), the
``torch._scaled_mm`` linear and the norms that emit FP8 against the float32 emulation (the same
quantized operands, so the only differences are float32 accumulation order and the output
rounding), whole blocks under ``fp8.autocast`` (fused kernels vs the unfused emulated program,
forward and backward), odd token counts, and CUDA-graph replays with fresh data. Skipped without
CUDA; the FP8 GEMM tests also without sm89+."""

import pytest
import torch

import opfuse
from opfuse import fp8, ops
from opfuse.families.linear.fp8 import reference as linear_reference
from opfuse.families.linear.fp8 import scaled_mm
from opfuse.families.quantize import kernels
from opfuse.fp8 import numerics

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = {"tensor": fp8.TensorScaling(), "row": fp8.RowwiseScaling(), "tensor-hp-wgrad": fp8.TensorScaling(
    fp8_wgrad=False), "row-fp8-wgrad": fp8.RowwiseScaling(fp8_wgrad=True),
    "tensor-pow2-weights": fp8.TensorScaling(pow2_weight_scales=True)}


def fp8_gemms() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


needs_fp8 = pytest.mark.skipif(not fp8_gemms(), reason="FP8 GEMMs tested on sm90")
needs_triton = pytest.mark.skipif(torch.cuda.is_available() and kernels.fast_path_reason(
    torch.empty(1, device="cuda")) is not None, reason="needs triton")


def rel(got, want):
    assert torch.isfinite(got).all(), "non-finite values"
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def randn(*shape, dtype=torch.bfloat16, seed=0, scale=1.0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)


# Quantizers -----------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1, 16), (17, 48), (300, 1000), (2048, 8192), (64, 14336), (8, 20000)])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantizers_match_numerics_bit_for_bit(dtype, shape, fmt):
    x = randn(*shape, dtype=dtype, seed=shape[0], scale=3.0)
    x[0, 0] = 0.0
    for rowwise in (False, True):
        got, want = kernels.quantize(x, fmt, rowwise), numerics.quantize(x, fmt, rowwise)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), (rowwise, "data")
        assert torch.equal(got.scale_inv, want.scale_inv), (rowwise, "scale")
    q, qt = kernels.quantize(x, fmt, False, transpose=True)
    assert torch.equal(qt.data.view(torch.uint8), q.data.t().contiguous().view(torch.uint8))
    valid = torch.tensor(shape[0] // 2, device=DEV)
    got, want = kernels.quantize(x, fmt, False, valid_rows=valid), numerics.quantize(x, fmt, False, valid_rows=valid)
    assert torch.equal(got.scale_inv, want.scale_inv)
    zero = torch.zeros(5, 32, device=DEV, dtype=dtype)
    assert torch.equal(kernels.quantize(zero, fmt, False).scale_inv, torch.ones(1, 1, device=DEV))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 16), (3, 17, 48), (8, 300, 1000), (4, 1024, 2048)])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_stack_quantizer_matches_each_matrix_quantized_alone(dtype, shape, fmt):
    """A grouped weight's experts, one scale each, both layouts in one pass: the bytes and scales
    of quantizing every expert by itself (the two-pass path), on dirty memory, with one expert all
    zeros and one 1000x larger than the others (the scales differ per expert)."""
    w = randn(*shape, dtype=dtype, seed=shape[1], scale=2.0)
    w[0].zero_()
    if shape[0] > 1:
        w[1] *= 1000.0 if dtype != torch.float16 else 10.0
    _dirty_allocator(4 * w.numel() + (1 << 20))
    data, data_t, scale_inv = kernels.quantize_stack(w, fmt)
    assert data.shape == shape and data_t.shape == (shape[0], shape[2], shape[1]) and scale_inv.shape == shape[:1]
    for g in range(shape[0]):
        want = numerics.quantize(w[g], fmt, False)
        assert torch.equal(data[g].view(torch.uint8), want.data.view(torch.uint8)), g
        assert torch.equal(data_t[g].view(torch.uint8), want.data.t().contiguous().view(torch.uint8)), g
        assert torch.equal(scale_inv[g].reshape(1, 1), want.scale_inv), g
    with pytest.raises(ValueError, match=r"\[groups, rows, cols\]"):
        kernels.quantize_stack(w[0], fmt)


@needs_triton
@pytest.mark.parametrize("sizes, tokens, cols", [([5, 0, 37, 100], 150, 200), ([0, 0, 3], 10, 48),
                                                 ([4000, 1, 17, 0], 4100, 1040), ([-3, 40, 200], 120, 32),
                                                 ([0, 0], 64, 16), ([256] * 16, 4096, 2048)])
def test_group_column_quantizer_matches_the_reference_bit_for_bit(sizes, tokens, cols):
    """The FP8 grouped weight gradient's operands: each group's column amax and the transposed,
    padded cast (``kernels.quantize_group_columns``) against ``fp8.grouped.group_columns_operand``,
    every byte (padding included: outputs start as NaN bytes), without a host sync."""
    from opfuse.fp8 import grouped

    t = randn(tokens, cols, seed=tokens, scale=3.0) * torch.logspace(-3, 2, cols, device=DEV).to(torch.bfloat16)
    t[:, 5] = 0
    group_sizes = torch.tensor(sizes, device=DEV)
    want = grouped.group_columns_operand(t, group_sizes)
    _dirty_allocator(4 * cols * (tokens + 16 * len(sizes)) + (1 << 20))
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = kernels.quantize_group_columns(t, group_sizes)
        again = kernels.quantize_group_columns(t, group_sizes, grouped.padded_group_ends(group_sizes, tokens))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    _same_bytes(again.data, got.data, "data with the caller's layout")
    _same_bytes(got.data, want.data, "data")
    assert torch.equal(got.scale_inv, want.scale_inv)


def _dirty_allocator(nbytes: int) -> None:
    """Fill and free a block of the caching allocator, so that outputs allocated next start as 0xFF
    bytes (NaN in both FP8 formats) instead of whatever was there: an element a kernel does not write
    shows up."""
    torch.empty(nbytes, dtype=torch.uint8, device=DEV).fill_(0xFF)


def _same_bytes(got, want, what):
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), what


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1, 16, 16), (3, 33, 257), (8, 512, 1024)])
def test_one_read_stack_quantizer_matches_each_matrix_quantized_alone(dtype, shape):
    """``weight_pow2.quantize_stack`` (experts' weights, one power-of-two scale each, one read)
    against each matrix's two-pass power-of-two quantization, bit for bit (dirty memory), while the
    experts' amaxes move apart: no hint, right hints, some wrong (one expert up, one down, one zero).
    The hints end as the true exponents."""
    from opfuse.families.quantize import weight_pow2

    groups = shape[0]
    base = randn(*shape, dtype=torch.float32, seed=shape[1] + 11, scale=3.0)
    key = ("gpu-test-stack", shape, str(dtype))
    factors = [torch.ones(groups), torch.ones(groups), torch.linspace(0.5, 4.0, groups),
               torch.linspace(4.0, 0.01, groups), torch.zeros(groups)]
    for step, factor in enumerate(factors):
        w = (base * factor.to(DEV).view(-1, 1, 1)).to(dtype)
        _dirty_allocator(6 * w.numel() + (1 << 20))
        data, data_t, scale_inv = weight_pow2.quantize_stack(w, E4M3, key)
        for g in range(groups):
            want = numerics.quantize(w[g], E4M3, False, pow2=True)
            _same_bytes(data[g], want.data, (step, g, "data"))
            _same_bytes(data_t[g], want.data.t().contiguous(), (step, g, "data_t"))
            assert torch.equal(scale_inv[g].reshape(1, 1), want.scale_inv), (step, g)
        amaxes = w.float().reshape(groups, -1).abs().amax(1)
        assert torch.equal(weight_pow2._hint(key, w.device, groups), numerics.pow2_exponent(amaxes, E4M3)), step
    with pytest.raises(ValueError, match=r"\[groups, rows, cols\]"):
        weight_pow2.quantize_stack(base[0], E4M3)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(1, 16), (17, 48), (33, 257), (300, 1000), (2048, 8192)])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_one_read_weight_quantizer_matches_two_passes_whatever_the_hint(dtype, shape, fmt):
    """``weight_pow2.quantize_weight`` against numerics' two-pass power-of-two quantization, bit for
    bit, while the weight's amax moves: the first call (no hint), the same exponent again (the one-
    read path), a step inside the exponent, up and down across powers of two (the hint wrong: the
    fixup casts again), a zero weight, a strided view. The hint ends as the true exponent."""
    from opfuse.families.quantize import weight_pow2

    base = randn(*shape, dtype=torch.float32, seed=shape[0] + 7, scale=3.0)
    key = ("gpu-test", shape, str(dtype), str(fmt))
    for step, factor in enumerate([1.0, 1.0, 1.05, 2.5, 0.1, 0.1, 0.0, 1.0]):
        w = (base * factor).to(dtype)
        want = numerics.quantize(w, fmt, False, pow2=True)
        for transpose in (True, False):
            _dirty_allocator(4 * w.numel() + (1 << 20))
            out = weight_pow2.quantize_weight(w, fmt, transpose, key=key)
            q, qt = out if transpose else (out, None)
            _same_bytes(q.data, want.data, (step, transpose, "data"))
            assert torch.equal(q.scale_inv, want.scale_inv), (step, transpose)
            if qt is not None:
                _same_bytes(qt.data, want.data.t().contiguous(), (step, "data_t"))
                assert torch.equal(qt.scale_inv, want.scale_inv)
        amax = w.float().abs().amax().reshape(1)
        hint = weight_pow2._hint(key, w.device)
        assert torch.equal(hint, numerics.pow2_exponent(amax, fmt)), step
    strided = randn(shape[1], shape[0], dtype=dtype, seed=3).t()  # not row-major
    q, qt = weight_pow2.quantize_weight(strided, fmt, True, key=key)
    want = numerics.quantize(strided.contiguous(), fmt, False, pow2=True)
    _same_bytes(q.data, want.data, "strided")
    _same_bytes(qt.data, want.data.t().contiguous(), "strided data_t")


@needs_triton
def test_one_read_weight_quantizer_in_a_cuda_graph_follows_the_weight_across_exponents():
    """Captured once, replayed while the weight is rescaled in place (the hint right, then wrong
    in both directions): every replay gives the two-pass bytes and scale."""
    from opfuse.families.quantize import weight_pow2

    w = randn(256, 512, dtype=torch.bfloat16, seed=11)
    base = w.clone()
    key = ("gpu-graph-test",)
    weight_pow2.quantize_weight(w, E4M3, True, key=key)  # warm-up outside the capture (Triton compiles)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        q, qt = weight_pow2.quantize_weight(w, E4M3, True, key=key)
    torch.cuda.current_stream().wait_stream(stream)
    for factor in (1.0, 1.0, 3.0, 3.1, 0.01, 0.01, 1.0):
        w.copy_(base.float().mul(factor).to(w.dtype))
        graph.replay()
        want = numerics.quantize(w, E4M3, False, pow2=True)
        _same_bytes(q.data, want.data, factor)
        _same_bytes(qt.data, want.data.t().contiguous(), factor)
        assert torch.equal(q.scale_inv, want.scale_inv), factor


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(16, 16), (33, 257), (2048, 8192)])
def test_separate_weights_in_one_launch_match_each_weight_quantized_alone(dtype, shape):
    """``weight_pow2.quantize_weights`` (separate same-shape weights found through an address
    table, one launch) against each weight's two-pass power-of-two quantization, bit for bit
    (dirty memory), while the amaxes move apart (hints right and wrong, one weight zero, one
    strided); the table follows new weights at new addresses."""
    from opfuse.families.quantize import weight_pow2

    key = ("gpu-test-weights", shape, str(dtype))
    bases = [randn(*shape, dtype=torch.float32, seed=s, scale=3.0) for s in range(4)]
    for step, factors in enumerate([(1, 1, 1, 1), (1, 1, 1, 1), (0.5, 2.0, 4.0, 1.0), (4.0, 0.01, 0.0, 1.0)]):
        ws = [(b * f).to(dtype) for b, f in zip(bases, factors)]
        ws[3] = torch.cat([ws[3], ws[3]], 1)[:, :shape[1]]  # strided
        _dirty_allocator(8 * ws[0].numel() + (1 << 20))
        data, data_t, scale_inv = weight_pow2.quantize_weights(ws, E4M3, True, key)
        for g, w in enumerate(ws):
            want = numerics.quantize(w, E4M3, False, pow2=True)
            _same_bytes(data[g], want.data, (step, g, "data"))
            _same_bytes(data_t[g], want.data.t().contiguous(), (step, g, "data_t"))
            assert torch.equal(scale_inv[g].reshape(1, 1), want.scale_inv), (step, g)
        amaxes = torch.stack([w.float().abs().amax() for w in ws])
        assert torch.equal(weight_pow2._hint(key, ws[0].device, 4), numerics.pow2_exponent(amaxes, E4M3)), step


@needs_triton
@pytest.mark.parametrize("table_before_capture", [True, False], ids=["table-kept", "capture-without-table"])
def test_separate_weights_in_one_launch_in_a_cuda_graph_follow_the_weights(table_before_capture, monkeypatch):
    """Captured once, replayed while the weights are rescaled in place: every replay gives each
    weight's two-pass bytes and scale, whether the capture found the address table made (a warm-up
    call) or had to launch each weight alone (no table can be copied inside a capture)."""
    from opfuse.families.quantize import weight_pow2

    ws = [randn(256, 512, dtype=torch.bfloat16, seed=s) for s in range(3)]
    bases = [w.clone() for w in ws]
    key = ("gpu-graph-weights", table_before_capture)
    # warm-up outside the capture (Triton compiles the kernels the capture launches): the table of
    # these weights, or the per-weight launches of other weights (no table at these addresses)
    with monkeypatch.context() as patch:
        if not table_before_capture:
            patch.setattr(weight_pow2, "is_capturing", lambda: True)
        weight_pow2.quantize_weights(ws if table_before_capture else [w.clone() for w in ws], E4M3, True, key)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        data, data_t, scale_inv = weight_pow2.quantize_weights(ws, E4M3, True, key)
    torch.cuda.current_stream().wait_stream(stream)
    for factors in ((1, 1, 1), (3, 0.01, 1), (3.1, 0.01, 0), (0.5, 1, 1)):
        for w, base, f in zip(ws, bases, factors):
            w.copy_(base.float().mul(f).to(w.dtype))
        graph.replay()
        for g, w in enumerate(ws):
            want = numerics.quantize(w, E4M3, False, pow2=True)
            _same_bytes(data[g], want.data, (factors, g))
            _same_bytes(data_t[g], want.data.t().contiguous(), (factors, g))
            assert torch.equal(scale_inv[g].reshape(1, 1), want.scale_inv), (factors, g)


# fp8_linear -------------------------------------------------------------------------------------------


@needs_fp8
@pytest.mark.parametrize("recipe", list(RECIPES), ids=str)
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (17, 48, 80), (333, 1024, 512), (4096, 4096, 2048)])
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_matches_emulation(recipe, m, k, n, bias):
    key = RECIPES[recipe].key()
    x = randn(m, k, seed=m, scale=2.0)
    w = randn(n, k, seed=n, scale=0.05)
    b = randn(n, seed=3) if bias else None
    dy = randn(m, n, seed=7)
    for weight in (w, w.clone().requires_grad_()):  # a trained weight: x's transposed bytes come with it
        y, data, scale, data_t = scaled_mm.forward(x, None, None, weight, b, key)
        y_ref, data_ref, scale_ref, _ = linear_reference.forward(x, None, None, weight, b, key)
        assert torch.equal(data.view(torch.uint8), data_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)
        if data_t.numel():
            assert torch.equal(data_t.view(torch.uint8), data.t().contiguous().view(torch.uint8))
        assert rel(y, y_ref) < 4e-3
    w = w.detach()
    grads = scaled_mm.backward(dy, data, scale, data_t, w, key, True, True, bias)
    grads_ref = linear_reference.backward(dy, data_ref, scale_ref, data_t, w, key, True, True, bias)
    for name, got, want in zip(("dx", "dw", "db"), grads, grads_ref):
        if want.numel():
            assert rel(got, want) < 4e-3, name
    # Against the unquantized GEMM: FP8 error, not garbage.
    assert rel(y, x.double() @ w.double().t() + (b.double() if bias else 0)) < 0.08


# Norms emitting FP8 --------------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("tokens,hidden", [(1, 128), (37, 5120), (513, 8192)])
def test_norm_quantize_kernel(norm, rowwise, tokens, hidden):
    norm_op = (ops.RMSNorm if norm == "rms" else ops.LayerNorm)(hidden, dtype=torch.bfloat16, device=DEV)
    with torch.no_grad():
        for p in norm_op.parameters():
            p.copy_(1 + 0.3 * randn(*p.shape, seed=5, dtype=torch.float32))
    recipe = fp8.RowwiseScaling() if rowwise else fp8.TensorScaling()
    block = ops.Sequential(ops.AddExtraInput(), ops.MakeExtraOutput(), norm_op, ops.Linear(hidden, 256, bias=False,
                                                                                          dtype=torch.bfloat16,
                                                                                          device=DEV))
    x, r = randn(tokens, hidden, seed=1, scale=2), randn(tokens, hidden, seed=2)
    dy, dh = randn(tokens, 256, seed=3), randn(tokens, hidden, seed=4)
    results = []
    for fuse in (True, False):
        xg, rg = x.clone().requires_grad_(), r.clone().requires_grad_()
        block.zero_grad(set_to_none=True)
        with opfuse.config.override(fuse=fuse), fp8.autocast(recipe=recipe):
            y, h = block(xg, rg)
            program = opfuse.compile(block, xg, rg)
        ((y.float() * dy.float()).sum() + (h.float() * dh.float()).sum()).backward()
        results.append([y, h, xg.grad, rg.grad] + [p.grad for p in block.parameters()])
        if fuse:
            rules = {f.rule: f.impl for f in program.fusions}
            assert rules.get(f"add_{norm}norm_quantize") == "triton", rules
            if fp8_gemms():
                assert rules.get("fp8_linear") == "scaled_mm", rules
    for got, want in zip(*results):
        assert rel(got, want) < 2e-2


# Blocks -------------------------------------------------------------------------------------------------


def mlp(hidden, ffn, dtype=torch.bfloat16):
    block = ops.Sequential(ops.RMSNorm(hidden, dtype=dtype, device=DEV), ops.Linear(hidden, ffn, dtype=dtype, device=DEV),
                           ops.GELU("tanh"), ops.Linear(ffn, hidden, dtype=dtype, device=DEV), ops.AddExtraInput(),
                           ops.MakeExtraOutput(), ops.RMSNorm(hidden, dtype=dtype, device=DEV))
    with torch.no_grad():
        for i, p in enumerate(block.parameters()):
            if p.dim() == 2:
                p.copy_(randn(*p.shape, seed=10 + i, scale=p.shape[1] ** -0.5, dtype=dtype))
    return block


@needs_fp8
@pytest.mark.parametrize("recipe", list(RECIPES), ids=str)
@pytest.mark.parametrize("tokens", [1, 77, 1024])
def test_block_fused_matches_unfused_emulation(recipe, tokens):
    block = mlp(512, 2048)
    x, r = randn(tokens, 512, seed=1), randn(tokens, 512, seed=2)
    dy, dh = randn(tokens, 512, seed=3), randn(tokens, 512, seed=4)
    results = []
    for fuse in (True, False):
        xg, rg = x.clone().requires_grad_(), r.clone().requires_grad_()
        block.zero_grad(set_to_none=True)
        with opfuse.config.override(fuse=fuse), fp8.autocast(recipe=RECIPES[recipe]):
            y, h = block(xg, rg)
        ((y.float() * dy.float()).sum() + (h.float() * dh.float()).sum()).backward()
        results.append([y, h, xg.grad, rg.grad] + [p.grad for p in block.parameters()])
    # Outputs agree to the GEMMs' accumulation order; gradients less closely: an E5M2 gradient
    # (2 mantissa bits) turns bf16-level differences upstream into flipped roundings.
    grad_tol = 0.1 if RECIPES[recipe].grad_dtype == E5M2 else 4e-2
    for i, (got, want) in enumerate(zip(*results)):
        assert rel(got, want) < (3e-2 if i < 2 else grad_tol), i
    # ... and close to the bf16 block (FP8 error, not garbage)
    with torch.no_grad():
        y16, _ = block(x, r)
    assert rel(results[0][0], y16) < 0.1


@needs_fp8
def test_graphed_fp8_block_replays_fresh_data():
    block = mlp(256, 1024)
    x, r = randn(64, 256, seed=1), randn(64, 256, seed=2)
    with fp8.autocast():
        graphed = opfuse.graphed(block, x.requires_grad_(), r)
        for step in range(5):
            xs, rs = randn(64, 256, seed=100 + step).requires_grad_(), randn(64, 256, seed=200 + step)
            y, h = graphed(xs, rs)
            y, h = y.clone(), h.clone()
            (y.float().sum() + h.float().sum()).backward()
            gx = xs.grad.clone()
            xe = xs.detach().clone().requires_grad_()
            ye, he = block(xe, rs)
            (ye.float().sum() + he.float().sum()).backward()
            assert rel(y, ye) < 1e-2 and rel(gx, xe.grad) < 1e-2, step
            with torch.no_grad():  # an optimizer step between replays: the cached FP8 weights must not go stale
                for p in block.parameters():
                    p.mul_(0.99)
            block.zero_grad(set_to_none=True)


# Grouped -------------------------------------------------------------------------------------------------


GROUPED_CASES = [  # tokens, groups, K, N, sizes (several non-empty groups: a kernel that computes only the
    # first group fails), bias
    (64, 4, 128, 64, [16, 0, 20, 28], False),
    (333, 8, 256, 512, [40, 0, 0, 100, 7, 90, 1, 60], True),   # odd sizes, empty groups, a 35-row tail
    (1024, 3, 512, 256, [0, 0, 0], False),                      # no tokens at all
    (4096, 16, 1024, 2048, [256] * 16, True),
]


@needs_fp8
@pytest.mark.parametrize("recipe", ["tensor", "row", "tensor-hp-wgrad", "row-fp8-wgrad", "tensor-pow2-weights"])
@pytest.mark.parametrize("case", range(len(GROUPED_CASES)))
def test_scaled_grouped_mm_matches_emulation(recipe, case):
    from opfuse.families.grouped_linear.fp8 import reference as grouped_reference
    from opfuse.families.grouped_linear.fp8 import scaled_grouped_mm

    tokens, groups, k, n, sizes, bias = GROUPED_CASES[case]
    key = RECIPES[recipe].key()
    x, w = randn(tokens, k, seed=1, scale=2.0), randn(groups, n, k, seed=2, scale=k ** -0.5)
    b = randn(groups, n, seed=3) if bias else None
    dy = randn(tokens, n, seed=4)
    sizes = torch.tensor(sizes, device=DEV, dtype=torch.int32)
    _dirty_allocator(8 * tokens * max(k, n) + 4 * groups * n * k)  # unwritten rows / experts show up as NaN
    with torch.cuda.device(DEV):
        torch.cuda.set_sync_debug_mode("error")  # device group sizes: no host sync in the kernels
        try:
            y = scaled_grouped_mm.forward(x, sizes, w, b, "", groups, key)
            grads = scaled_grouped_mm.backward(dy, x, sizes, w, b, "", groups, key, True, True, bias)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    y_ref = grouped_reference.forward(x, sizes, w, b, "", groups, key)
    grads_ref = grouped_reference.backward(dy, x, sizes, w, b, "", groups, key, True, True, bias)
    valid = int(sizes.sum())
    assert (y[valid:] == 0).all(), "rows past sum(group_sizes) must be zero"
    if valid:
        assert rel(y, y_ref) < 4e-3
    for name, got, want in zip(("dx", "dw", "db"), grads, grads_ref):
        if want.numel() and want.abs().sum() > 0:
            assert rel(got, want) < 4e-3, name
        elif want.numel():
            assert (got == 0).all(), name
    if valid:  # FP8 error against the unquantized grouped GEMM, not garbage
        starts = [0] + torch.cumsum(sizes, 0).tolist()[:-1]
        full = torch.cat([x[s:s + c].double() @ w[g].double().t() + (b[g].double() if bias else 0)
                          for g, (s, c) in enumerate(zip(starts, sizes.tolist()))])
        assert rel(y[:valid], full) < 0.08
        full_dw = torch.stack([dy[s:s + c].double().t() @ x[s:s + c].double()
                               for s, c in zip(starts, sizes.tolist())])
        assert rel(grads[1], full_dw) < 0.08


@needs_fp8
@pytest.mark.parametrize("recipe", ["tensor", "row"])
def test_scaled_grouped_mm_follows_in_place_updates_of_a_view_weight(recipe):
    """The weight as a compiled graph passes it: a fresh view of a stacked storage on every call. The
    second call with an unchanged storage reuses the FP8 copies; an in-place update through another
    view is seen by the next call, forward and data gradient."""
    from opfuse.families.grouped_linear.fp8 import reference as grouped_reference
    from opfuse.families.grouped_linear.fp8 import scaled_grouped_mm

    tokens, groups, k, n = 256, 4, 128, 64
    key = RECIPES[recipe].key()
    stacked = randn(2, groups, n, k, seed=2, scale=k ** -0.5)
    x, dy = randn(tokens, k, seed=1), randn(tokens, n, seed=4)
    sizes = torch.tensor([64, 0, 100, 92], device=DEV, dtype=torch.int32)

    def run():
        y = scaled_grouped_mm.forward(x, sizes, stacked[1], None, "", groups, key)
        dx = scaled_grouped_mm.backward(dy, x, sizes, stacked[1], None, "", groups, key, True, False, False)[0]
        return y, dx

    def reference():
        w = stacked[1].clone()
        return (grouped_reference.forward(x, sizes, w, None, "", groups, key),
                grouped_reference.backward(dy, x, sizes, w, None, "", groups, key, True, False, False)[0])

    first = run()
    assert torch.equal(run()[0], first[0])
    for got, want in zip(first, reference()):
        assert rel(got, want) < 4e-3
    stacked[1, 2].mul_(-3.0)  # through another view: the version counter the views share moves
    second = run()
    assert not torch.equal(second[0], first[0])
    for got, want in zip(second, reference()):
        assert rel(got, want) < 4e-3


@needs_fp8
def test_scaled_grouped_mm_backward_takes_the_forwards_weight(monkeypatch):
    """Inductor's code passes a fresh alias of the weight's storage on every call (no ``_base``, a
    version of its own): the weight is quantized once for a forward and its backward (same
    activation), and the data gradient is the one a fresh quantization gives."""
    from opfuse.families.grouped_linear.fp8 import scaled_grouped_mm

    tokens, groups, k, n = 256, 4, 128, 64
    key = RECIPES["tensor"].key()
    stacked = randn(groups, n, k, seed=2, scale=k ** -0.5)
    x, dy = randn(tokens, k, seed=1), randn(tokens, n, seed=4)
    sizes = torch.tensor([64, 0, 100, 92], device=DEV, dtype=torch.int32)
    calls = []
    real = kernels.quantize_stack
    monkeypatch.setattr(kernels, "quantize_stack", lambda *args, **kw: calls.append(1) or real(*args, **kw))

    def alias():
        return torch.empty(0, device=DEV, dtype=stacked.dtype).set_(stacked.untyped_storage(), 0, stacked.shape,
                                                                      stacked.stride())

    scaled_grouped_mm.forward(x, sizes, alias(), None, "", groups, key)
    dx = scaled_grouped_mm.backward(dy, x, sizes, alias(), None, "", groups, key, True, False, False)[0]
    assert len(calls) == 1
    fresh = scaled_grouped_mm.backward(dy, x.clone(), sizes, alias(), None, "", groups, key, True, False, False)[0]
    assert len(calls) == 2 and torch.equal(dx, fresh)


@needs_fp8
def test_grouped_fp8_graph_replays_new_routing():
    layer = ops.GroupedLinear(8, 256, 128, device=DEV, dtype=torch.bfloat16)
    block = ops.Sequential(layer)
    tokens = 512
    x = randn(tokens, 256, seed=1).requires_grad_()
    sizes = torch.tensor([64] * 8, device=DEV, dtype=torch.int32)
    with fp8.autocast():
        graphed = opfuse.graphed(block, x, sizes)
        assert opfuse.compile(block, x, sizes).fusions[0].impl == "scaled_grouped_mm"
        for step in range(4):
            gen = torch.Generator(device=DEV).manual_seed(step)
            new_sizes = torch.randint(0, 90, (8,), generator=gen, device=DEV, dtype=torch.int32)
            xs = randn(tokens, 256, seed=10 + step).requires_grad_()
            y = graphed(xs, new_sizes).clone()
            y.float().sum().backward()
            xe = xs.detach().clone().requires_grad_()
            with opfuse.config.override(force_impl="grouped_linear_fp8=reference"):
                ye = block(xe, new_sizes)
            ye.float().sum().backward()
            assert rel(y, ye) < 1e-2 and rel(xs.grad, xe.grad) < 1e-2, step


@needs_fp8
def test_frozen_weights_graph_reads_the_cached_fp8_weights():
    block = mlp(256, 1024)
    x, r = randn(16, 256, seed=1), randn(16, 256, seed=2)
    with torch.no_grad(), fp8.autocast(frozen_weights=True):
        eager, _ = block(x, r)
        graph = torch.cuda.CUDAGraph()
        static = block(x, r)  # warm: FP8 weights cached
        with torch.cuda.graph(graph):
            static = block(x, r)
        graph.replay()
        assert rel(static[0], eager) < 1e-6
