"""The FP8 epilogue of the peer-memory all-reduce + add + RMSNorm kernels on one GPU, with
simulated ranks (tests/gpu/test_residual_norm_kernels.py's ``SimulatedRanks``).

For every case the plain kernel (y in the activation dtype) and the FP8 one run on the same
inputs; the FP8 bytes and scales must equal the reference quantizer's (opfuse.fp8.numerics) applied
to the plain kernel's y, bit for bit, and be identical on every rank; h must equal the plain
kernel's. Per row: one kernel. Per tensor: the kernel's row amaxes, their max, and the cast pass
(``add_norm_fp8`` over h).
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from opfuse.runtime import extension  # noqa: E402
from opfuse.fp8 import numerics  # noqa: E402

from .test_residual_norm_kernels import SimulatedRanks, code, make, norm_code  # noqa: E402

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# (tokens, hidden): 1 / odd / many tokens, hidden sizes that are odd multiples of 8 elements.
SHAPES = [(1, 2888), (7, 1000), (33, 5128), (130, 2888), (2, 8200)]


@pytest.fixture(scope="module")
def ext():
    return extension.load("residual_norm")


def fp8_call(ext, sim, xs, bias, residual, weight, fmt, rowwise, eps=1e-6, sync=True):
    """The FP8 variant on every simulated rank: ``[(q, scale_inv, h)]`` per rank."""
    tokens, hidden = xs[0].shape
    code8 = ext.FP8_FORMATS[fmt]
    qs = [torch.empty(tokens, hidden, dtype=FP8[fmt], device="cuda") for _ in xs]
    if rowwise:
        scales = [torch.full((tokens, 1), float("nan"), device="cuda") for _ in xs]
        epilogues = [ext.Fp8Epilogue(ext.QUANT["rowwise"], code8, q.data_ptr(), s.data_ptr()) for q, s in zip(qs, scales)]
        _, hs = sim.run(xs, bias, residual, weight, None, "rms", eps=eps, epilogues=epilogues, sync=sync)
        return list(zip(qs, scales, hs))
    amaxes = [torch.full((tokens,), float("nan"), device="cuda") for _ in xs]
    epilogues = [ext.Fp8Epilogue(ext.QUANT["row_amax"], code8, 0, a.data_ptr()) for a in amaxes]
    _, hs = sim.run(xs, bias, residual, weight, None, "rms", eps=eps, epilogues=epilogues, sync=sync)
    out = []
    for q, row_amax, h in zip(qs, amaxes, hs):
        amax = row_amax.amax().reshape(1, 1)
        scale_inv = torch.full((1, 1), float("nan"), device="cuda")
        epilogue = ext.Fp8Epilogue(ext.QUANT["tensor"], code8, q.data_ptr(), scale_inv.data_ptr(), amax.data_ptr())
        ext.add_norm_fp8(epilogue, h.data_ptr(), 0, 0, 0 if weight is None else weight.data_ptr(), 0, 0, 0, tokens,
                         hidden, eps, norm_code("rms"), code(h.dtype), 64, torch.cuda.current_stream().cuda_stream)
        out.append((q, scale_inv, h))
    if sync:
        torch.cuda.synchronize()
    return out


def check_against_plain(results, y_plain, h_plain, fmt, rowwise, tag):
    want = numerics.quantize(y_plain.float(), FP8[fmt], rowwise)
    for r, (q, scale_inv, h) in enumerate(results):
        assert torch.equal(h, h_plain), f"{tag} rank {r}: h differs from the plain kernel's"
        assert torch.equal(scale_inv, want.scale_inv), \
            f"{tag} rank {r}: scale_inv {scale_inv.flatten()[:4].tolist()} != {want.scale_inv.flatten()[:4].tolist()}"
        same = q.view(torch.uint8) == want.data.view(torch.uint8)
        assert same.all(), f"{tag} rank {r}: {int((~same).sum())} FP8 bytes differ from the reference quantizer"
        assert torch.equal(q.view(torch.uint8), results[0][0].view(torch.uint8)), f"{tag}: rank {r} != rank 0"


@pytest.mark.parametrize("kind", ["oneshot", "twoshot"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp8_epilogue_equals_the_reference_quantizer_of_the_plain_kernel(ext, kind, world, dtype):
    gen = torch.Generator(device="cuda").manual_seed(world * 10 + (dtype == torch.float16))
    sim = SimulatedRanks(ext, kind, world, dtype, capacity=4 << 20)
    for i, (tokens, hidden) in enumerate(SHAPES):
        xs, bias, res, w, _ = make(tokens, hidden, dtype, world, gen, with_bias=i % 2 == 0)
        ys, hs = sim.run(xs, bias, res, w, None, "rms")
        for fmt in ("e4m3", "e5m2"):
            for rowwise in (True, False):
                tag = f"{kind} world {world} {dtype} T={tokens} H={hidden} {fmt} {'row' if rowwise else 'tensor'}"
                results = fp8_call(ext, sim, xs, bias, res, w, fmt, rowwise)
                check_against_plain(results, ys[0], hs[0], fmt, rowwise, tag)


def test_fp8_epilogue_outliers_zero_rows_and_float32(ext):
    """A row of zeros (scale 1), a large outlier (saturation-free scaling), float32 activations."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        sim = SimulatedRanks(ext, "oneshot", 2, dtype, capacity=1 << 20)
        xs, bias, res, w, _ = make(6, 1000, dtype, 2, gen, with_bias=False)
        for x in xs:
            x[2] = 0
            x[4, 17] = 3e3
        res[2] = 0
        ys, hs = sim.run(xs, None, res, w, None, "rms")
        for fmt in ("e4m3", "e5m2"):
            for rowwise in (True, False):
                results = fp8_call(ext, sim, xs, None, res, w, fmt, rowwise)
                check_against_plain(results, ys[0], hs[0], fmt, rowwise, f"{dtype} {fmt} rowwise={rowwise}")
                if rowwise:
                    assert results[0][1][2].item() == 1.0  # all-zero row: scale 1


def test_fp8_epilogue_in_a_cuda_graph_replays_with_fresh_data(ext):
    world, tokens, hidden, dtype = 2, 9, 2888, torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(11)
    sim = SimulatedRanks(ext, "oneshot", world, dtype, capacity=1 << 20)
    xs, bias, res, w, _ = make(tokens, hidden, dtype, world, gen)
    fp8_call(ext, sim, xs, bias, res, w, "e4m3", True)  # warm up (and advance the protocol state)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        results = fp8_call(ext, sim, xs, bias, res, w, "e4m3", True, sync=False)
    for step in range(3):
        fresh, fresh_bias, fresh_res, fresh_w, _ = make(tokens, hidden, dtype, world, gen)
        for x, f in zip(xs, fresh):
            x.copy_(f)
        res.copy_(fresh_res)
        graph.replay()
        torch.cuda.synchronize()
        ys, hs = sim.run(xs, bias, res, w, None, "rms")
        check_against_plain([(q, s, h) for q, s, h in results], ys[0], hs[0], "e4m3", True, f"replay {step}")


def test_fp8_epilogue_argument_errors(ext):
    x = torch.zeros(4, 1000, dtype=torch.bfloat16, device="cuda")
    q = torch.empty(4, 1000, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(4, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    bad = [(ext.Fp8Epilogue(7, 0, q.data_ptr(), s.data_ptr()), "quant must be"),
           (ext.Fp8Epilogue(ext.QUANT["tensor"], 0, q.data_ptr(), s.data_ptr()), "needs amax"),
           (ext.Fp8Epilogue(ext.QUANT["rowwise"], 0, q.data_ptr(), s.data_ptr()), "not compiled with"),
           (ext.Fp8Epilogue(ext.QUANT["tensor"], 3, q.data_ptr(), s.data_ptr(), s.data_ptr()), "fp8 must be")]
    for epilogue, message in bad:
        with pytest.raises(RuntimeError, match=message):
            ext.add_norm_fp8(epilogue, x.data_ptr(), 0, 0, 0, 0, 0, 0, 4, 1000, 1e-6, norm_code("rms"),
                             code(x.dtype), 4, stream)
    with pytest.raises(RuntimeError, match="needs a norm"):
        ext.add_norm_fp8(ext.Fp8Epilogue(ext.QUANT["tensor"], 0, q.data_ptr(), s.data_ptr(), s.data_ptr()),
                         x.data_ptr(), 0, 0, 0, 0, 0, 0, 4, 1000, 1e-6, norm_code("none"), code(x.dtype), 4, stream)
