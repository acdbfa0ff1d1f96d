"""The FP8 all-gather + GEMM plan (``p2p_overlap`` of ``all_gather_linear_fp8``) run on CPU: each rank
a thread, shared CPU storage as the symmetric pool (the harness of test_overlap_executor), regions
viewed as E4M3 bytes, the GEMMs as ``torch._scaled_mm`` (CPU kernels in this torch): the gathered
bytes and every shard's GEMM against the float64 product of the dequantized operands."""

import threading

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


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="torch without _scaled_mm")
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("chunks", [1, 2, 4], ids=["direct", "ring-rows", "ring-four"])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_reduce_scatter_sums_each_ranks_scaled_product(fake_cuda, monkeypatch, world, chunks, bias):  # noqa: F811
    """``linear_reduce_scatter_fp8``'s ``p2p_overlap`` forward: each rank quantizes its own ``x``
    (its own scale: nothing shared) and runs the bfloat16 op's reduce-scatter plan with FP8 GEMMs;
    a ring hop adds its product to the incoming partial (``torch._scaled_mm`` has no beta). Rows
    reduced over the ranks against float64 of the dequantized operands; the payload it keeps for the
    backward is the FP8 ``x`` the GEMMs read."""
    import opfuse
    from opfuse.families.collective_linear.fp8 import p2p as fp8_p2p
    from opfuse.fp8 import TensorScaling
    from opfuse.ops import group as groups

    rows, k, n = 8, 32, 64  # rows per rank
    recipe = TensorScaling()
    contexts = {}
    monkeypatch.setattr(p2p, "_context", lambda group, t: contexts[threading.current_thread().name])
    monkeypatch.setattr(groups, "from_name", lambda name: name)
    monkeypatch.setattr(groups, "world_size", lambda group: world)
    xs = [(torch.randn(world * rows, k, generator=torch.Generator().manual_seed(r)) * (1 + r)).to(torch.bfloat16)
          for r in range(world)]
    ws = [(torch.randn(n, k, generator=torch.Generator().manual_seed(50 + r)) / 4).to(torch.bfloat16)
          for r in range(world)]
    b = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)

    def fn(r, ctx):
        contexts[threading.current_thread().name] = ctx
        with opfuse.config.override(overlap_chunks=chunks):
            y, data, scale, _ = fp8_p2p.rs_forward(xs[r], None, None, ws[r], b if bias else None, "g", recipe.key())
        bound = [plan for plan in ctx.plans.values() if plan.scaled]
        accumulating = [line for line in bound[0].source.splitlines() if "_add_(" in line and "_smm(" in line]
        assert len(bound) == 1 and (accumulating or chunks == 1), bound[0].source  # a ring hop accumulates
        return y, data, scale

    results, _ = _run_ranks(world, fn)
    products = [results[r][1].double() * results[r][2].double() @ numerics.quantize(
        ws[r], E4M3, False).dequantize(torch.float64).t() for r in range(world)]
    total = sum(products)
    for r, (y, data, scale) in enumerate(results):
        assert data.dtype == E4M3 and data.shape == (world * rows, k) and scale.numel() == 1
        want = total[r * rows:(r + 1) * rows] + (b.double() if bias else 0)
        # each product rounded to bf16 once, each hop's sum once more
        size = sum(p[r * rows:(r + 1) * rows].abs() for p in products) + (b.double().abs() if bias else 0)
        assert ((y.double() - want).abs() <= (world + 1) * 2 ** -8 * size + 1e-6).all(), (r, (y.double() - want))


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="torch without _scaled_mm")
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)], ids=["dx+dw", "dx", "dw"])
def test_fp8_reduce_scatter_backward_gathers_dy_under_the_dgrad(fake_cuda, monkeypatch, world, need):  # noqa: F811
    """``linear_reduce_scatter_fp8``'s ``p2p_overlap`` backward: ``dy`` quantized with the group's
    scale (e5m2), pushed to every peer while each arrived shard's dgrad GEMM runs; the gathered
    ``dy`` kept in the region feeds the FP8 wgrad. Against float64 of the same FP8 operands."""
    from opfuse.families.collective_linear.fp8 import common as fp8_common, p2p as fp8_p2p
    from opfuse.families.linear.fp8 import scaled_mm
    from opfuse.fp8 import TensorScaling
    from opfuse.ops import group as groups

    need_dx, need_dw = need
    rows, k, n = 8, 32, 48  # dy rows per rank; weight [n, k] per rank (a row-parallel shard)
    recipe = TensorScaling()
    contexts = {}
    monkeypatch.setattr(p2p, "_context", lambda group, t: contexts[threading.current_thread().name])
    monkeypatch.setattr(groups, "from_name", lambda name: name)
    dys = [(torch.randn(rows, n, generator=torch.Generator().manual_seed(r)) * (1 + r)).to(torch.bfloat16)
           for r in range(world)]
    amax = torch.stack([d.float().abs().max() for d in dys]).max().reshape(1)
    # the all-reduced amax, as the group's ranks agree on it
    monkeypatch.setattr(fp8_common, "shared_quantize", lambda rows_, dtype, rowwise, pg, quantize, amax_fn: quantize(
        rows_, dtype, False, amax_value=amax))
    ws = [(torch.randn(n, k, generator=torch.Generator().manual_seed(50 + r)) / 4).to(torch.bfloat16)
          for r in range(world)]
    xs = [numerics.quantize(torch.randn(world * rows, k, generator=torch.Generator().manual_seed(70 + r)), E4M3,
                            False) for r in range(world)]

    def fn(r, ctx):
        contexts[threading.current_thread().name] = ctx
        dx, dw, db = fp8_p2p.rs_backward(dys[r], xs[r].data, xs[r].scale_inv, xs[r].data.new_empty(0), ws[r], "g",
                                         recipe.key(), need_dx, need_dw, True)
        assert [plan for plan in ctx.plans.values() if plan.scaled], "the peer-memory plan did not run"
        return dx, dw, db

    results, _ = _run_ranks(world, fn)
    gathered = torch.cat([numerics.quantize(d.float(), torch.float8_e5m2, False, amax_value=amax)
                          .dequantize(torch.float64) for d in dys])
    for r, (dx, dw, db) in enumerate(results):
        if need_dx:
            wt = scaled_mm.weight_t_operand(ws[r], recipe).dequantize(torch.float64)  # [k, n]
            torch.testing.assert_close(dx.double(), gathered @ wt.t(), atol=2e-2, rtol=1e-2)
        else:
            assert dx.numel() == 0
        if need_dw:
            want = gathered.t() @ xs[r].dequantize(torch.float64)
            torch.testing.assert_close(dw.double(), want, atol=5e-2, rtol=1e-2)
        else:
            assert dw.numel() == 0
        torch.testing.assert_close(db.double(), dys[r].double().sum(0), atol=5e-2, rtol=1e-2)
