"""The SM-carveout GEMMs of the torch.compile front end (opfuse/torch_compile/sm_carveout.py) on a
GPU: the product of the GEMM they replace (float64 reference), for FP8 ``_scaled_mm`` (also with an operand in the
layout cuBLASLt refuses, which the op copies into one it takes) and bf16 ``mm`` (routed through
cuBLASLt for the call); torch's carveout and preferred BLAS backend are restored afterwards, and
the calls replay in a CUDA graph with fresh data. Skipped without CUDA; FP8 without sm90."""

import pytest
import torch

from opfuse.torch_compile import sm_carveout  # noqa: F401  (registers the ops)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

needs_fp8 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                               reason="FP8 GEMMs tested on sm90")
SMS = 8


@pytest.fixture(autouse=True)
def torch_state_restored():
    """torch's carveout and preferred BLAS backend are what they were before each test."""
    before = (torch._C._get_sm_carveout_experimental(), torch._C._get_blas_preferred_backend())
    yield
    assert (torch._C._get_sm_carveout_experimental(), torch._C._get_blas_preferred_backend()) == before


def _close(got, a, b, scale_a=1.0, scale_b=1.0):
    """``got`` against the float64 product of the dequantized operands (bf16 output rounding)."""
    want = (a.double() * scale_a) @ (b.double() * scale_b)
    assert torch.isfinite(got).all()
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-2


@needs_fp8
@pytest.mark.parametrize("m,n,k", [(256, 512, 1024), (96, 48, 64)])
@pytest.mark.parametrize("b_layout", ["column-major", "row-major"])
def test_scaled_mm_with_carveout_is_scaled_mm(m, n, k, b_layout):
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b_cols = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()  # [k, n], column-major
    scale_a, scale_b = torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")
    b = b_cols if b_layout == "column-major" else b_cols.contiguous()
    got = torch.ops.opfuse.scaled_mm_sm_carveout(a, b, scale_a, scale_b, None, torch.bfloat16, False, SMS)
    _close(got, a, b_cols, 0.5, 2.0)


@pytest.mark.parametrize("m,n,k", [(512, 256, 1024), (33, 17, 65)])
def test_mm_with_carveout_matches_mm(m, n, k):
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    _close(torch.ops.opfuse.mm_sm_carveout(a, b, SMS), a, b)


@needs_fp8
def test_carveout_gemm_replays_in_a_cuda_graph():
    torch.manual_seed(0)
    a = torch.randn(128, 256, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(64, 256, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up outside the capture (cuBLASLt workspace)
        torch.ops.opfuse.scaled_mm_sm_carveout(a, b, one, one, None, torch.bfloat16, False, SMS)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.opfuse.scaled_mm_sm_carveout(a, b, one, one, None, torch.bfloat16, False, SMS)
    for _ in range(2):
        a.copy_(torch.randn(128, 256, device="cuda").to(torch.float8_e4m3fn))
        out.fill_(float("nan"))
        graph.replay()
        _close(out, a, b)


def test_a_carveout_of_every_sm_is_refused_by_name():
    count = torch.cuda.get_device_properties(0).multi_processor_count
    a = torch.randn(8, 8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"OPFUSE_OVERLAP_SM_CARVEOUT={count}.*accepted: 0 to {count - 1}"):
        torch.ops.opfuse.mm_sm_carveout(a, a, count)
