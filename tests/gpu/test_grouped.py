"""GroupedLinear on CUDA: every GPU implementation of ``grouped_linear`` against a float32/float64
loop of matmuls (bf16/fp16/fp32, uneven, empty and truncated groups, odd sizes, gradients), with
outputs poisoned (NaN) before the kernels run; every tile configuration the tuning script may pick
for the persistent kernel; no host sync under ``torch.cuda.set_sync_debug_mode("error")``;
CUDA-graph capture of forward + backward replayed with new group sizes computed on the device; the
measured order of this GPU. Skipped without CUDA."""

import math
import zlib

import pytest
import torch

import opfuse
from opfuse import ops
from opfuse.core import dispatch as implementations
from opfuse.machinery.implementation import CallSpec
from opfuse.families.grouped_linear import persistent, torch_mm, triton_impl, tuning
from opfuse.machinery.implementation import choose

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
GPU_IMPLS = ["triton_tma", "torch_grouped_mm", "triton", "triton_persistent"]
# Norm-wise relative error against a float64 loop; fp32 runs exact ("ieee") products.
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}


def rel_err(got, ref):
    assert torch.isfinite(got).all(), "non-finite values (an element left unwritten?)"
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def clamped(sizes, tokens):
    """Row ranges after the kernels' clamping (negative counts -> 0, ends -> tokens)."""
    out, start = [], 0
    for count in sizes:
        end = min(start + max(count, 0), tokens)
        out.append((start, end))
        start = end
    return out


def loop(x, sizes, w, b=None, dy=None):
    """float64 loop: y, and with ``dy`` also dx, dW, db."""
    x, w = x.double(), w.double()
    tokens = x.shape[0]
    y = x.new_zeros(tokens, w.shape[1])
    dx, dw, db = torch.zeros_like(x), torch.zeros_like(w), x.new_zeros(w.shape[:2])
    for g, (s, e) in enumerate(clamped(sizes, tokens)):
        y[s:e] = x[s:e] @ w[g].t() + (b[g].double() if b is not None else 0)
        if dy is not None:
            d = dy[s:e].double()
            dx[s:e], dw[g], db[g] = d @ w[g], d.t() @ x[s:e], d.sum(0)
    return (y, dx, dw, db) if dy is not None else y


def spec_for(dtype, tokens, groups, k, n, bias):
    meta = lambda shape, dt: opfuse.ops.TensorMeta(tuple(shape), dt, torch.device(DEV))  # noqa: E731
    return CallSpec("grouped_linear", {
        "x": meta([tokens, k], dtype), "group_sizes": meta([groups], torch.int32),
        "weight": meta([groups, n, k], dtype), "bias": meta([groups, n], dtype) if bias else None},
        {"fsdp": False})


def require(impl, dtype, tokens, groups, k, n, bias):
    reason = implementations.get("grouped_linear", impl).check(spec_for(dtype, tokens, groups, k, n, bias))
    if reason:
        pytest.skip(f"{impl}: {reason}")


def poison_allocator(*shapes_dtypes):
    """Hand NaN-filled blocks back to the caching allocator, so tensors that a kernel allocates
    next hold NaN wherever it forgets to write."""
    blocks = [torch.full(shape, float("nan"), dtype=dt, device=DEV) for shape, dt in shapes_dtypes]
    del blocks


def random_sizes(gen, groups, tokens, empty=(), tail=0):
    """Uneven counts summing to ``tokens - tail`` with the groups in ``empty`` at zero."""
    weights = torch.rand(groups, generator=gen) + 0.05
    for g in empty:
        weights[g] = 0
    counts = (weights / weights.sum() * (tokens - tail)).floor().long()
    counts[int(torch.argmax(weights))] += tokens - tail - int(counts.sum())
    return counts.tolist()


SHAPES = [  # tokens, groups, K, N, sizes or (empty, tail)
    (512, 8, 256, 128, ((1, 5), 0)),
    (1000, 6, 1001, 77, ((0,), 37)),        # odd K and N: triton only
    (64, 16, 512, 256, ((2, 3, 4), 5)),     # decode-like: few rows per group
    (3000, 4, 384, 640, ((), 0)),           # several m-tiles per group
    (300, 3, 128, 64, "truncated"),         # sum(sizes) > T: clamped, memory-safe
    (96, 4, 64, 48, "all-empty"),
]


def case_sizes(gen, tokens, groups, how):
    if how == "truncated":
        return [200, -5, 250]
    if how == "all-empty":
        return [0] * groups
    empty, tail = how
    return random_sizes(gen, groups, tokens, empty, tail)


@pytest.mark.parametrize("impl", GPU_IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}G{s[1]}K{s[2]}N{s[3]}")
def test_implementation_matches_loop(impl, dtype, shape):
    tokens, groups, k, n, how = shape
    bias = impl != "torch_grouped_mm"
    require(impl, dtype, tokens, groups, k, n, bias)
    gen = torch.Generator().manual_seed(zlib.crc32(repr((impl, dtype, shape)).encode()))
    sizes = case_sizes(gen, tokens, groups, how)
    x = torch.randn(tokens, k, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(groups, n, k, generator=gen) / math.sqrt(k)).to(dtype).to(DEV)
    b = torch.randn(groups, n, generator=gen).to(dtype).to(DEV) if bias else None
    dy = torch.randn(tokens, n, generator=gen).to(dtype).to(DEV)
    counts = torch.tensor(sizes, dtype=torch.int32, device=DEV)
    chosen = implementations.get("grouped_linear", impl)

    poison_allocator(((tokens, n), dtype), ((tokens, k), dtype), ((groups, n, k), dtype))
    y = chosen.forward(x, counts, w, b)
    dx, dw, db = chosen.backward(dy, x, counts, w, need_dx=True, need_dw=True, need_db=bias)
    torch.cuda.synchronize()
    ry, rdx, rdw, rdb = loop(x, sizes, w, b, dy)
    tol = TOL[dtype]
    assert rel_err(y, ry) <= tol
    assert rel_err(dx, rdx) <= tol
    assert rel_err(dw, rdw) <= tol or rdw.abs().max() == 0
    if bias:
        assert rel_err(db, rdb) <= tol or rdb.abs().max() == 0
    for g, (s, e) in enumerate(clamped(sizes, tokens)):
        if e == s:      # empty (or truncated-away) group: exact zeros, nothing stale
            assert torch.equal(dw[g], torch.zeros_like(dw[g]))
    end = clamped(sizes, tokens)[-1][1]
    assert torch.equal(y[end:], torch.zeros_like(y[end:])) and torch.equal(dx[end:], torch.zeros_like(dx[end:]))


@pytest.mark.parametrize("use_tma", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_launchers_write_every_element(use_tma, dtype):
    if triton_impl.triton_status():
        pytest.skip(triton_impl.triton_status())
    gen = torch.Generator().manual_seed(3)
    tokens, groups, k, n = 777, 5, 192, 320
    sizes = [0, 300, 0, 250, 100]      # empty first/middle, 127 tail rows
    x = torch.randn(tokens, k, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(groups, n, k, generator=gen) / math.sqrt(k)).to(dtype).to(DEV)
    dy = torch.randn(tokens, n, generator=gen).to(dtype).to(DEV)
    counts = torch.tensor(sizes, dtype=torch.int64, device=DEV)
    nan = lambda *s: torch.full(s, float("nan"), dtype=dtype, device=DEV)  # noqa: E731
    y = triton_impl.grouped_mm(x, counts, w, nk=True, use_tma=use_tma, out=nan(tokens, n))
    dx = triton_impl.grouped_mm(dy, counts, w, nk=False, use_tma=use_tma, out=nan(tokens, k))
    dw, db = triton_impl.grouped_wgrad(dy, x, counts, groups, need_db=True, dw=nan(groups, n, k), db=nan(groups, n))
    ry, rdx, rdw, rdb = loop(x, sizes, w, None, dy)
    for name, got, want in (("y", y, ry), ("dx", dx, rdx), ("dw", dw, rdw), ("db", db, rdb)):
        assert rel_err(got, want) <= TOL[dtype], name


# One shape per size class: rows 16-byte aligned but K and N no multiples of the tiles, empty
# groups (first and middle) and a tail past sum(sizes).
CLASS_SHAPES = {"decode": (96, 16, 264, 200), "small_m": (1200, 16, 264, 200), "large_m": (2600, 6, 520, 328)}


@pytest.mark.parametrize("cls", tuning.SIZE_CLASSES)
def test_persistent_tiles_match_loop(cls):
    """Every tile configuration of the class (default and the tuning candidates, warp-specialised
    ones included) computes forward and dgrad right."""
    tokens, groups, k, n = CLASS_SHAPES[cls]
    assert tuning.size_class(tokens, groups, k, n) == cls
    require("triton_persistent", torch.bfloat16, tokens, groups, k, n, True)
    gen = torch.Generator().manual_seed(zlib.crc32(cls.encode()))
    sizes = random_sizes(gen, groups, tokens, empty=(0, 3), tail=13)
    x = torch.randn(tokens, k, generator=gen).to(torch.bfloat16).to(DEV)
    w = (torch.randn(groups, n, k, generator=gen) / math.sqrt(k)).to(torch.bfloat16).to(DEV)
    b = torch.randn(groups, n, generator=gen).to(torch.bfloat16).to(DEV)
    dy = torch.randn(tokens, n, generator=gen).to(torch.bfloat16).to(DEV)
    counts = torch.tensor(sizes, dtype=torch.int32, device=DEV)
    ry, rdx, _, _ = loop(x, sizes, w, b, dy)
    end = clamped(sizes, tokens)[-1][1]
    for tiles in (persistent.default_tiles(cls), *persistent.CANDIDATES[cls]):
        nan = lambda *shape: torch.full(shape, float("nan"), dtype=torch.bfloat16, device=DEV)  # noqa: E731
        y = persistent.grouped_mm_persistent(x, counts, w, nk=True, bias=b, out=nan(tokens, n), config=tiles)
        dx = persistent.grouped_mm_persistent(dy, counts, w, nk=False, out=nan(tokens, k), config=tiles)
        torch.cuda.synchronize()
        assert rel_err(y, ry) <= TOL[torch.bfloat16], tiles
        assert rel_err(dx, rdx) <= TOL[torch.bfloat16], tiles
        assert torch.equal(y[end:], torch.zeros_like(y[end:])), tiles


def build_block(dtype, groups, k, n, bias, gen):
    layer = ops.GroupedLinear(groups, k, n, bias=bias, device=DEV, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen).to(dtype) / math.sqrt(k))
        if bias:
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen).to(dtype))
    return layer, ops.Sequential(layer)


def device_routing(tokens, groups, drop=True):
    """Counts of a random routing computed on the device (no host values): tokens sent to bin
    ``groups`` are dropped, leaving a tail."""
    bins = torch.randint(0, groups + int(drop), (tokens,), device=DEV)
    counts = torch.zeros(groups + 1, dtype=torch.int64, device=DEV)
    counts.scatter_add_(0, bins, torch.ones_like(bins))
    return counts[:groups].to(torch.int32)


@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_no_host_sync(impl):
    dtype, tokens, groups, k, n = torch.bfloat16, 1024, 8, 256, 256
    bias = impl != "torch_grouped_mm"
    require(impl, dtype, tokens, groups, k, n, bias)
    gen = torch.Generator().manual_seed(5)
    layer, block = build_block(dtype, groups, k, n, bias, gen)
    x = torch.randn(tokens, k, generator=gen).to(dtype).to(DEV).requires_grad_()
    dy = torch.randn(tokens, n, generator=gen).to(dtype).to(DEV)
    with opfuse.config.override(force_impl=f"grouped_linear={impl}"):
        counts = device_routing(tokens, groups)
        block(x, counts).backward(dy)          # compile and JIT the kernels first
        assert block.program(x, counts).fusions[0].impl == impl
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                counts = device_routing(tokens, groups)
                block(x, counts).backward(dy)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_cuda_graph_replays_new_device_sizes(impl):
    dtype, tokens, groups, k, n = torch.bfloat16, 512, 8, 128, 192
    bias = impl != "torch_grouped_mm"
    require(impl, dtype, tokens, groups, k, n, bias)
    gen = torch.Generator().manual_seed(11)
    layer, block = build_block(dtype, groups, k, n, bias, gen)
    params = [p for p in layer.parameters()]
    x = torch.randn(tokens, k, generator=gen).to(dtype).to(DEV).requires_grad_()
    dy = torch.randn(tokens, n, generator=gen).to(dtype).to(DEV)
    counts = device_routing(tokens, groups)
    with opfuse.config.override(force_impl=f"grouped_linear={impl}"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):          # warm-up (compile, JIT, autograd) off the capture stream
            for _ in range(2):
                block(x, counts).backward(dy)
        torch.cuda.current_stream().wait_stream(side)
        x.grad = None
        for p in params:
            p.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = block(x, counts)
            y.backward(dy)
        for step in range(40):
            # New routing and new data, written on the device into the captured buffers.
            counts.copy_(device_routing(tokens, groups, drop=step % 2 == 0))
            with torch.no_grad():
                x.copy_(torch.randn(tokens, k, device=DEV).to(dtype))
                dy.copy_(torch.randn(tokens, n, device=DEV).to(dtype))
            graph.replay()
            torch.cuda.synchronize()
            sizes = counts.tolist()
            ry, rdx, rdw, rdb = loop(x.detach(), sizes, layer.weight.detach(),
                                     layer.bias.detach() if bias else None, dy)
            assert rel_err(y, ry) <= TOL[dtype], f"replay {step} y"
            assert rel_err(x.grad, rdx) <= TOL[dtype], f"replay {step} dx"
            assert rel_err(layer.weight.grad, rdw) <= TOL[dtype], f"replay {step} dW"
            for g, count in enumerate(sizes):
                if count == 0:
                    assert torch.equal(layer.weight.grad[g], torch.zeros_like(layer.weight.grad[g]))


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("tokens", [256, 4096, 32768])
def test_measured_order_of_this_gpu_picks_its_first_capable_entry(tokens, training):
    """On a GPU kind with measurements, the dispatch takes the fastest capable implementation of
    the call's size class; elsewhere the table order."""
    s = spec_for(torch.bfloat16, tokens, 32, 7168, 2048, False)
    s = CallSpec(s.op, s.inputs, s.attrs, requires_grad=training)
    measured = tuning.measured_order(s)
    choice = choose(s, implementations.for_op("grouped_linear", s))
    capable = [name for name in measured if implementations.get("grouped_linear", name).check(s) is None]
    if capable:
        assert choice.name == capable[0]
    else:
        assert [impl.name for impl in implementations.for_op("grouped_linear", s)] == \
            implementations.names()["grouped_linear"]
    assert choice.name != "reference"


def test_gpu_dispatch_picks_a_kernel():
    gen = torch.Generator().manual_seed(2)
    layer, block = build_block(torch.bfloat16, 8, 256, 256, False, gen)
    x = torch.randn(256, 256, generator=gen).to(torch.bfloat16).to(DEV)
    fusion = block.program(x, device_routing(256, 8)).fusions[0]
    assert fusion.impl != "reference", fusion.skipped


def test_torch_grouped_mm_rejects_sync_paths():
    s = spec_for(torch.float16, 64, 4, 64, 64, False)
    assert "only bfloat16" in torch_mm.check(s)
    assert torch_mm.check(spec_for(torch.bfloat16, 64, 4, 60, 64, False)) is not None
