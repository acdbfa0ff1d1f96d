"""``allreduce_add_rmsnorm_quantize`` on spawned gloo processes (world 2 and 4): the rule fires
in a tensor-parallel FP8 block (row-parallel GEMM -> all-reduce + residual add + RMSNorm -> the next
column-parallel FP8 GEMM), and its implementations (the composed fallbacks run here: the reference)
match a float64 computation of the unfused math: the residual, y dequantized and the scales;
gradients equal the unfused block's."""

import pytest
import torch
import torch.distributed as dist

from opfuse import fp8, ops
from opfuse.core import dispatch as implementations
from opfuse.families.residual_norm.op import AllReduceAddRMSNormQuantize
from opfuse.ops.base import TensorMeta

from ..fp8_reference import E4M3, E5M2, fq, fused_and_unfused

RECIPES = (fp8.TensorScaling(), fp8.RowwiseScaling())


def data(seed, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def close(name, got, want, **tol):
    try:
        torch.testing.assert_close(got.double(), want.double(), **tol)
    except AssertionError as error:
        raise AssertionError(f"{name}: {error}") from None


def op_against_float64(rank, world):
    """The fused op alone, each implementation capable here, against float64 math of its
    documentation: h = dtype(sum_ranks(x) + b + r), y = dtype(rms(h) * w), y quantized."""
    hidden, tokens = 24, 5
    for dtype in (torch.float32, torch.bfloat16):
        for fmt, rowwise, shared in (("e4m3", True, False), ("e5m2", False, False), ("e4m3", False, True)):
            xs = [data(10 + r, tokens, hidden, dtype=dtype) for r in range(world)]
            res, bias = data(20, tokens, hidden, dtype=dtype), data(21, hidden, dtype=dtype) * 0.1
            weight = (1 + 0.2 * data(22, hidden)).to(dtype)
            op = AllReduceAddRMSNormQuantize(group=dist.group.WORLD, bias=bias, weight=weight, eps=1e-5,
                                             export_residual=True, dtype=fmt, rowwise=rowwise,
                                             amax_group=dist.group.WORLD if shared else None)
            ran = []
            for impl in implementations.for_op(op.name):
                if impl.check(op.call_spec([TensorMeta.of(xs[rank]), TensorMeta.of(res)])) is not None:
                    continue
                ran.append(impl.name)
                op.implementation = impl
                y, h = op(xs[rank], res)
                tag = f"rank {rank} {impl.name} {dtype} {fmt} {'row' if rowwise else 'tensor'} shared={shared}"
                want_h = (sum(x.double() for x in xs) + bias.double() + res.double()).to(dtype)
                tol = dict(atol=0.05, rtol=2 ** -6) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
                close(f"{tag} h", h, want_h, **tol)
                hf = h.double()
                y64 = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
                fp8_dtype = E4M3 if fmt == "e4m3" else E5M2
                assert isinstance(y, fp8.Float8Activation) and y.fp8_dtype == fp8_dtype, tag
                amax = y64.abs().amax(-1, keepdim=True) if rowwise else y64.abs().amax().reshape(1, 1)
                fp8_max = 448.0 if fmt == "e4m3" else 57344.0
                close(f"{tag} scale_inv", y._scale_inv, amax / fp8_max, rtol=1e-2, atol=0)
                close(f"{tag} y", y.dequantize(torch.float64), fq(y64, fp8_dtype, rowwise),
                      rtol=0, atol=float(amax.max()) * (2 ** -3 if fmt == "e4m3" else 2 ** -2))
                if shared:  # one scale on every rank of the amax group (equal anyway: y is replicated)
                    scales = [torch.empty_like(y._scale_inv) for _ in range(world)]
                    dist.all_gather(scales, y._scale_inv.contiguous())
                    assert all(torch.equal(s, scales[0]) for s in scales), tag
            assert "reference" in ran, ran


def block_fused_vs_unfused(rank, world, recipe):
    """Row-parallel GEMM -> all-reduce + add + RMSNorm -> column-parallel FP8 GEMM: the rule fires
    and outputs and gradients equal the unfused FP8 block's."""
    hidden, ffn, tokens = 8 * world, 16 * world, 6
    block = ops.Sequential(ops.Linear(ffn, hidden, parallel="row"), ops.AddExtraInput(), ops.MakeExtraOutput(),
                           ops.RMSNorm(hidden), ops.Linear(hidden, ffn, parallel="column"))
    with torch.no_grad():
        for i, p in enumerate(block.parameters()):
            p.copy_(data(100 + i, *p.shape) * (p.shape[-1] ** -0.5 if p.dim() == 2 else 0.1) + (p.dim() == 1))
    x, r = data(200 + rank, tokens, ffn // world), data(300, tokens, hidden)
    dy, dh = data(400 + rank, tokens, ffn // world), data(500, tokens, hidden)
    results, fusions = fused_and_unfused(block, x, r, dy, dh, recipe)
    assert "allreduce_add_rmsnorm_quantize" in fusions and "allreduce_add_rmsnorm" not in fusions, fusions
    for i, (got, want) in enumerate(zip(*results)):
        close(f"rank {rank} {recipe.describe()} block output/grad {i}", got, want, atol=1e-5, rtol=1e-5)


def all_cases(rank, world):
    op_against_float64(rank, world)
    for recipe in RECIPES:
        block_fused_vs_unfused(rank, world, recipe)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_allreduce_add_rmsnorm_quantize(world, session_spawn):
    session_spawn.run(all_cases, world)


#: Run with other modules' Sequential cases in one spawn per world for the session
#: (tests/dist/shared_spawn.py); a case that does not finish there runs alone in its test.
SESSION_CASES = [(all_cases, 2, ()), (all_cases, 4, ())]
