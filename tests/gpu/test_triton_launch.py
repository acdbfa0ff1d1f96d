"""opfuse's cached Triton launches on a GPU (opfuse/runtime/triton_launch.py): the same bytes as
Triton's own launch path, one cached kernel per specialization, a misaligned input compiled
apart, launches captured into a CUDA graph replayed with fresh data."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

triton = pytest.importorskip("triton")

from opfuse import config  # noqa: E402
from opfuse.families.quantize import kernels as qk  # noqa: E402
from opfuse.families.residual_norm.fp8 import triton_impl as norm_quantize  # noqa: E402
from opfuse.runtime import triton_launch  # noqa: E402


def _cast(x):
    q = qk.quantize(x, torch.float8_e4m3fn, False)
    return q.data.view(torch.uint8).clone(), q.scale_inv.clone()


def _norm(x, res, w):
    y, h = norm_quantize.forward(x, None, res, w, None, 1e-6, True, "e4m3", False, "", norm="rms")
    return y._data.view(torch.uint8).clone(), y._scale_inv.clone(), h.clone()


@pytest.mark.parametrize("rows,cols", [(1, 16), (37, 5120), (2048, 2048), (5, 4099)])
def test_cached_launches_match_tritons_path(rows, cols):
    gen = torch.Generator(device="cuda").manual_seed(rows * 7919 + cols)
    x = torch.randn(rows, cols, generator=gen, device="cuda").to(torch.bfloat16)
    res = torch.randn(rows, cols, generator=gen, device="cuda").to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(cols, generator=gen, device="cuda")).to(torch.bfloat16)
    with config.override(triton_launch_cache=False):
        expected = (_cast(x), _norm(x, res, w))
    first = (_cast(x), _norm(x, res, w))  # the miss: Triton's path, then cached
    size = triton_launch.cache_size()
    for _ in range(3):
        again = (_cast(x), _norm(x, res, w))
        assert triton_launch.cache_size() == size  # hits only
    for got in (first, again):
        for a, b in zip(sum(got, ()), sum(expected, ())):
            assert torch.equal(a, b)


def test_misaligned_input_compiles_its_own_kernel():
    gen = torch.Generator(device="cuda").manual_seed(3)
    base = torch.randn(64 * 1024 + 1, generator=gen, device="cuda").to(torch.float16)
    aligned, shifted = base[:64 * 1024].view(64, 1024), base[1:].view(64, 1024)
    _cast(aligned)
    size = triton_launch.cache_size()
    got = _cast(shifted)  # 2-byte aligned: another specialization
    assert triton_launch.cache_size() == size + 1
    with config.override(triton_launch_cache=False):
        assert all(torch.equal(a, b) for a, b in zip(got, _cast(shifted)))


def test_cached_launch_in_a_cuda_graph_replays_with_fresh_data():
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(256, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    _cast(x)  # compiled and cached outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        _cast(x)
        with torch.cuda.graph(graph, stream=stream):
            q = qk.quantize(x, torch.float8_e4m3fn, False)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(3):
        x.copy_(torch.randn(256, 4096, generator=gen, device="cuda").to(torch.bfloat16) * (seed + 1))
        q.data.view(torch.uint8).fill_(0x7F)  # NaN in e4m3
        graph.replay()
        with config.override(triton_launch_cache=False):
            ref = qk.quantize(x, torch.float8_e4m3fn, False)
        assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(q.scale_inv, ref.scale_inv)
