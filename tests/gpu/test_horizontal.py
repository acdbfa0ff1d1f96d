"""The horizontal_gemm pass on real GPUs: a gated MLP (``ops.GatedLinear``) in bf16 / fp16 whose
gate and up GEMMs run as one GEMM over a view of both weights and whose activation runs on the
packed output (``gated_activation``, Triton), against the float32 math of the unfused layer
(outputs and every gradient); CUDA-graph capture of forward + backward replayed
with fresh inputs and an optimizer step in between (the joined weight is read in place); and, at
NCCL world 2+, the sequence-parallel layer whose all-gather the fused op absorbs, run by
``p2p_overlap`` (all_gather_linear's overlap over the joined weight).

    PYTHONPATH=. python3 -m pytest -q tests/gpu/test_horizontal.py
"""

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # inherited by the spawned ranks
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")

import opfuse  # noqa: E402
from opfuse import ops  # noqa: E402
from opfuse.ops.packing import adjacent  # noqa: E402

from ..dist.harness import run  # noqa: E402

TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def rel(got, ref):
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(name, got, ref, dtype):
    assert got is not None and tuple(got.shape) == tuple(ref.shape), f"{name}: {got} vs shape {tuple(ref.shape)}"
    assert bool(torch.isfinite(got).all()), f"{name}: non-finite values"
    err = rel(got, ref)
    assert err < TOL[dtype], f"{name}: relative error {err:.3e} >= {TOL[dtype]}"


def reference(x, gate, up, gb, ub, dy):
    """float32 gated layer over copies: (y, dx, dgate, dup, dgb, dub)."""
    leaves = [t.detach().float().requires_grad_() for t in (x, gate, up)]
    biases = [t.detach().float().requires_grad_() for t in (gb, ub)] if gb is not None else []
    xf, gf, uf = leaves
    a, b = F.linear(xf, gf), F.linear(xf, uf)
    if biases:
        a, b = a + biases[0], b + biases[1]
    y = F.silu(a) * b
    y.backward(dy.float())
    return [y.detach()] + [t.grad for t in leaves + biases]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,hidden,ffn,bias", [(1, 256, 512, False), (37, 320, 200, True),
                                                     (2048, 1024, 2816, False)])
def test_fused_gated_layer_single_gpu(dtype, tokens, hidden, ffn, bias):
    torch.manual_seed(tokens)
    layer = ops.GatedLinear(hidden, ffn, bias=bias, device="cuda", dtype=dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * hidden ** -0.5)
    block = ops.Sequential(layer)
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, ffn, device="cuda", dtype=dtype)
    y = block(x)
    y.backward(dy)
    record, gated = [f for f in opfuse.compile(block, x).fusions if f.rule == "horizontal_gemm"]
    assert record.impl == "reference" and adjacent([layer.gate_weight, layer.up_weight])
    assert gated.ops == ("GatedActivation",) and gated.impl == "triton", gated
    want = reference(x, layer.gate_weight, layer.up_weight, layer.gate_bias, layer.up_bias, dy)
    got = [y, x.grad, layer.gate_weight.grad, layer.up_weight.grad]
    if bias:
        got += [layer.gate_bias.grad, layer.up_bias.grad]
    for name, g, w in zip(["y", "dx", "dgate", "dup", "dgate_bias", "dup_bias"], got, want):
        check(name, g, w, dtype)


def test_graphed_block_reads_the_joined_weight_in_place():
    torch.manual_seed(0)
    dtype, hidden, ffn, tokens = torch.bfloat16, 512, 1024, 64
    block = ops.Sequential(ops.RMSNorm(hidden, device="cuda", dtype=dtype),
                           ops.GatedLinear(hidden, ffn, bias=True, device="cuda", dtype=dtype),
                           ops.Linear(ffn, hidden, bias=False, device="cuda", dtype=dtype))
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
    step = opfuse.graphed(block, x, clone_outputs=True)
    gated = block[1]
    for replay in range(3):
        xi = torch.randn_like(x).requires_grad_()
        dy = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
        for p in block.parameters():
            p.grad = None
        y = step(xi)
        y.backward(dy)
        got = [y, xi.grad, gated.gate_weight.grad.clone(), gated.up_weight.grad.clone()]
        for p in block.parameters():
            p.grad = None
        xe = xi.detach().clone().requires_grad_()
        with opfuse.config.override(fuse=False):
            ye = block(xe)
        ye.backward(dy)
        want = [ye, xe.grad, gated.gate_weight.grad, gated.up_weight.grad]
        for name, g, w in zip(["y", "dx", "dgate", "dup"], got, want):
            check(f"replay {replay} {name}", g, w, dtype)
        with torch.no_grad():  # an optimizer step, in place: the next replay must see it
            for p in block.parameters():
                p.add_(torch.randn_like(p) * 1e-2)


def _sequence_parallel(rank, world):
    torch.cuda.set_device(rank)
    dtype, hidden, ffn = torch.bfloat16, 1024, 512 * world
    for tokens, bias in ((8 * world, False), (512 * world, True)):
        torch.manual_seed(1)  # the same full weights and inputs on every rank
        full_gate = torch.randn(ffn, hidden, device="cuda") * hidden ** -0.5
        full_up = torch.randn(ffn, hidden, device="cuda") * hidden ** -0.5
        full_gb, full_ub = torch.randn(ffn, device="cuda") * 0.1, torch.randn(ffn, device="cuda") * 0.1
        x_full, dy_full = torch.randn(tokens, hidden, device="cuda"), torch.randn(tokens, ffn, device="cuda")
        layer = ops.GatedLinear(hidden, ffn, bias=bias, parallel="column", sequence_parallel=True, device="cuda",
                                dtype=dtype)
        layer.load_unsharded(gate=full_gate.to(dtype), up=full_up.to(dtype),
                             gate_bias=full_gb.to(dtype) if bias else None, up_bias=full_ub.to(dtype) if bias else None)
        block = ops.Sequential(layer)
        n, t = ffn // world, tokens // world
        x = x_full[rank * t:(rank + 1) * t].to(dtype).requires_grad_()
        dy = dy_full[:, rank * n:(rank + 1) * n].to(dtype)
        y = block(x)
        y.backward(dy)
        record, gated = [f for f in opfuse.compile(block, x).fusions if f.rule == "horizontal_gemm"]
        assert record.ops[0] == "AllGather" and record.impl == "p2p_overlap", record
        assert gated.impl == "triton", gated
        # Reference: the full (gathered) input through this rank's shards in float32; dx reduce-scattered.
        want = reference(x_full.to(dtype), layer.gate_weight, layer.up_weight, layer.gate_bias, layer.up_bias, dy)
        dx_full = want[1].contiguous()
        dx = torch.empty_like(dx_full[:t])
        dist.reduce_scatter_tensor(dx, dx_full)
        want[1] = dx
        got = [y, x.grad, layer.gate_weight.grad, layer.up_weight.grad]
        if bias:
            got += [layer.gate_bias.grad, layer.up_bias.grad]
        for name, g, w in zip(["y", "dx", "dgate", "dup", "dgate_bias", "dup_bias"], got, want):
            check(f"tokens={tokens} {name}", g, w, dtype)
    dist.barrier()


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_sequence_parallel_gated_layer_overlaps_its_all_gather():
    run(_sequence_parallel, 2, backend="nccl")
