"""Fused ops through opfuse programs on one GPU: (bias +) add + RMSNorm/LayerNorm with the CUDA
kernel, forward and backward, and LinearBiasActivation with the cuBLASLt epilogue."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

import opfuse  # noqa: E402
from opfuse import ops  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def randomize_(module, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((1 + 0.2 * torch.randn(p.shape, generator=gen, device="cuda")).to(p.dtype))
    return module


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("tokens,hidden", [(1, 2880), (37, 5120), (512, 8192), (3, 16384)])
def test_add_norm_kernel_in_a_program(dtype, norm, tokens, hidden):
    norm_op = ops.RMSNorm(hidden, dtype=dtype, device="cuda") if norm == "rms" else \
        ops.LayerNorm(hidden, dtype=dtype, device="cuda")
    block = randomize_(ops.Sequential(ops.Bias(hidden, dtype=dtype, device="cuda"), ops.AddExtraInput(),
                                      ops.MakeExtraOutput(), norm_op))
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype).requires_grad_()
    r = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype).requires_grad_()
    dy = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    dh = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    y, h = block(x, r)
    record = opfuse.compile(block, x, r).fusions[0]
    assert record.rule == f"add_{norm}norm" and record.impl == "cuda", record
    (y.float() * dy.float() + h.float() * dh.float()).sum().backward()
    grads = [x.grad, r.grad] + [p.grad for p in block.parameters()]
    # float64 reference of the unfused chain
    leaves = [t.detach().double().requires_grad_() for t in (x, r)]
    params = [p.detach().double().requires_grad_() for p in block.parameters()]
    hr = leaves[0] + params[0] + leaves[1]
    if norm == "rms":
        yr = hr / torch.sqrt((hr * hr).mean(-1, keepdim=True) + norm_op.eps) * params[1]
    else:
        mu = hr.mean(-1, keepdim=True)
        yr = (hr - mu) / torch.sqrt(((hr - mu) ** 2).mean(-1, keepdim=True) + norm_op.eps) * params[1] + params[2]
    (yr * dy.double() + hr * dh.double()).sum().backward()
    assert rel(y, yr) < TOL[dtype] and rel(h, hr) < TOL[dtype]
    for got, want in zip(grads, [t.grad for t in leaves] + [p.grad for p in params]):
        assert rel(got, want) < 3 * TOL[dtype], rel(got, want)


def test_standalone_rmsnorm_uses_the_kernel_and_inference_skips_the_residual():
    block = randomize_(ops.Sequential(ops.RMSNorm(4096, dtype=torch.bfloat16, device="cuda")))
    x = torch.randn(9, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y = block(x)
        program = opfuse.compile(block, x)
    assert program.fusions[0].impl == "cuda"
    assert not program.graph_module.get_submodule(program.fusions[0].fused_node).write_residual
    ref = torch.nn.functional.rms_norm(x.float(), (4096,), block[0].weight.float(), 1e-6)
    assert rel(y, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_linear_bias_gelu_epilogue(dtype):
    block = ops.Sequential(ops.Linear(1024, 4096, dtype=dtype, device="cuda"), ops.GELU("tanh"))
    x = torch.randn(64, 1024, device="cuda", dtype=dtype)
    with torch.no_grad():
        y = block(x)
        program = opfuse.compile(block, x)
    assert program.fusions[0].impl == "cublaslt_epilogue"
    ref = torch.nn.functional.gelu(x.double() @ block[0].weight.double().T + block[0].bias.double(),
                                   approximate="tanh")
    assert rel(y, ref) < TOL[dtype]
    xg = x.clone().requires_grad_()
    yg = block(xg)  # training: the reference keeps the pre-activation
    assert opfuse.compile(block, xg).fusions[0].impl == "reference"
    yg.sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_backward_kernel_rounds_the_residual_gradient_sum_once(kind, dtype):
    """The residual's gradient nearly cancels the norm's input gradient: the kernel adds it in
    float32 before rounding (two roundings: ~0.3 relative error of dx in bf16)."""
    from tests.unit.test_numerics import cancelling_case, norm_block, rel_err

    gen = torch.Generator().manual_seed(3)
    x, r, w, dy, dh_out, want = cancelling_case(kind, dtype, gen, tokens=64, hidden=4096)
    block = norm_block(kind, dtype, w).cuda()
    x, r = x.cuda().requires_grad_(), r.cuda().requires_grad_()
    y, h = block(x, r)
    assert opfuse.compile(block, x, r).fusions[0].impl == "cuda"
    torch.autograd.backward((y, h), (dy.cuda(), dh_out.cuda()))
    assert rel_err(x.grad.cpu(), want) < 0.02


def test_compiled_linears_under_autocast():
    """torch.compile with Inductor, float32 parameters under ``torch.autocast`` (bf16): the cast
    weights are still linears (GEMM + bias + GELU through cuBLASLt's epilogue at inference), and a
    training step's float32 gradients match eager autocast's."""
    import copy

    from torch import nn

    model = randomize_(nn.Sequential(nn.Linear(512, 1024), nn.GELU(approximate="tanh"), nn.Linear(1024, 512)).cuda())
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(64, 512, generator=gen, device="cuda")
    inference = opfuse.optimize(copy.deepcopy(model))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert rel(inference(x), model(x)) < TOL[torch.bfloat16]
    fusions = [(f.rule, f.impl) for p in opfuse.programs(inference) for f in p.fusions]
    assert ("linear_bias_activation", "cublaslt_epilogue") in fusions, fusions
    trained = copy.deepcopy(model)
    compiled = opfuse.optimize(trained)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, want = compiled(x), model(x)
    got.float().square().sum().backward()
    want.float().square().sum().backward()
    for (name, mine), ref in zip(trained.named_parameters(), model.parameters()):
        assert mine.grad.dtype == torch.float32 and rel(mine.grad, ref.grad) < TOL[torch.bfloat16], name
