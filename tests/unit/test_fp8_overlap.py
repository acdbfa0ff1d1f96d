"""The FP8 all-gather + GEMM plan (``p2p_overlap`` of ``all_gather_linear_fp8``) run on CPU: each rank
a thread, shared CPU storage as the symmetric pool (the harness of test_overlap_executor), regions
viewed as E4M3 bytes, the GEMMs as ``torch._scaled_mm`` (CPU kernels in this torch): the gathered
bytes and every shard's GEMM against the float64 product of the dequantized operands."""

import pytest
import torch

from opfuse.families.collective_linear import p2p
from opfuse.families.collective_linear.overlap import planner as plans
from opfuse.fp8 import numerics

from .test_overlap_executor import _run_ranks, fake_cuda  # noqa: F401 - the fixture

E4M3 = torch.float8_e4m3fn


def _operand(seed, *shape):
    gen = torch.Generator().manual_seed(seed)
    return numerics.quantize(torch.randn(*shape, generator=gen), E4M3, False)


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="torch without _scaled_mm")
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gather_plan_moves_bytes_and_scales_each_shard(fake_cuda, world, bias):  # noqa: F811
    rows, k, n = 4, 32, 16
    amax = torch.tensor([[3.0]])  # one scale shared by the ranks (as the op all-reduces it)
    xs = [numerics.quantize(torch.randn(rows, k, generator=torch.Generator().manual_seed(r)), E4M3, False,
                            amax_value=amax) for r in range(world)]
    w = _operand(99, n, k)
    b = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)

    def fn(r, ctx):
        request = plans.gather_request(rows, k, n, bias=bias, itemsize=1)
        bound = p2p._bound(ctx, request, E4M3, scaled=True)
        assert bound is not None and "_smm(" in bound.source
        out = torch.full((world * rows, n), float("nan"), dtype=torch.bfloat16)
        bound(w.data.t(), a=xs[r].data, out=out, biasin=b.reshape(1, n) if bias else None,
              sa=xs[r].scale_inv.reshape(()), sb=w.scale_inv.reshape(()), odt=torch.bfloat16)
        return out

    results, _ = _run_ranks(world, fn)
    full = torch.cat([x.dequantize(torch.float64) for x in xs])
    want = full @ w.dequantize(torch.float64).t() + (b.double() if bias else 0)
    for out in results:
        torch.testing.assert_close(out.double(), want, atol=0.05, rtol=1e-2)  # bf16 output rounding


def test_an_fp8_plan_cannot_accumulate():
    from opfuse.families.collective_linear.overlap import executor

    with pytest.raises(ValueError, match="cannot accumulate"):
        compiler = executor._Compiler.__new__(executor._Compiler)
        compiler.bound = type("B", (), {"scaled": True})()
        compiler.scaled_gemm(executor.Gemm("compute", None, None, 0, 4, mode="acc"), "d", "a", "b")
