"""Every basic op, forward and backward, against an independent float64 reference."""

import math

import pytest
import torch

from opfuse import ops
from opfuse.ops.base import OpInputError

TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float64: 1e-12}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rel_err(got, ref):
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def randomize_(module, gen):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * 0.5 + 0.1)
    return module


# Independent float64 formulas (not calling opfuse).
def ref_rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def ref_layer(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def ref_gelu(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def ref_swiglu(x):
    a, b = x.chunk(2, -1)
    return a * torch.sigmoid(a) * b


CASES = {
    "BasicLinear": (lambda dt: ops.BasicLinear(12, 20, dtype=dt), 12, lambda x, p: x @ p["weight"].T),
    "Bias": (lambda dt: ops.Bias(12, dtype=dt), 12, lambda x, p: x + p["bias"]),
    "Linear": (lambda dt: ops.Linear(12, 20, dtype=dt), 12, lambda x, p: x @ p["weight"].T + p["bias"]),
    "LinearNoBias": (lambda dt: ops.Linear(12, 20, bias=False, dtype=dt), 12, lambda x, p: x @ p["weight"].T),
    "RMSNorm": (lambda dt: ops.RMSNorm(12, eps=1e-5, dtype=dt), 12, lambda x, p: ref_rms(x, p["weight"], 1e-5)),
    "LayerNorm": (lambda dt: ops.LayerNorm(12, eps=1e-5, dtype=dt), 12,
                  lambda x, p: ref_layer(x, p["weight"], p["bias"], 1e-5)),
    "GELU": (lambda dt: ops.GELU(), 12, lambda x, p: ref_gelu(x, "none")),
    "GELUtanh": (lambda dt: ops.GELU("tanh"), 12, lambda x, p: ref_gelu(x, "tanh")),
    "SwiGLU": (lambda dt: ops.SwiGLU(), 12, lambda x, p: ref_swiglu(x)),
    "Identity": (lambda dt: ops.Identity(), 12, lambda x, p: x),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("lead", [(5,), (2, 3)], ids=["2d", "3d"])
def test_op_forward_backward_matches_float64(name, dtype, lead, rng):
    make, features, formula = CASES[name]
    op = randomize_(make(dtype), rng)
    x64 = torch.randn(*lead, features, generator=rng, dtype=torch.float64)
    x = x64.to(dtype).requires_grad_()
    y = op(x)
    params64 = {n: p.detach().double().requires_grad_() for n, p in op.named_parameters()}
    xr = x.detach().double().requires_grad_()
    yr = formula(xr, params64)
    assert y.dtype == dtype and y.shape == yr.shape
    assert rel_err(y, yr) < TOL[dtype], f"{name} forward"
    dy = torch.randn(yr.shape, generator=rng, dtype=torch.float64)
    y.backward(dy.to(dtype))
    yr.backward(dy)
    assert rel_err(x.grad, xr.grad) < 2 * TOL[dtype], f"{name} dx"
    for n, p in op.named_parameters():
        assert rel_err(p.grad, params64[n].grad) < 2 * TOL[dtype], f"{name} d{n}"


def test_add_extra_input_and_make_extra_output_in_sequential(rng):
    seq = ops.Sequential(ops.AddExtraInput(), ops.MakeExtraOutput(), ops.RMSNorm(8))
    randomize_(seq, rng)
    x = torch.randn(4, 8, generator=rng, dtype=torch.float64).requires_grad_()
    r = torch.randn(4, 8, generator=rng, dtype=torch.float64).requires_grad_()
    seq.double()
    y, h = seq(x, r)
    hr = x.detach() + r.detach()
    torch.testing.assert_close(h, hr)
    torch.testing.assert_close(y, ref_rms(hr, seq[2].weight.detach(), 1e-6))
    dy, dh = torch.randn_like(y), torch.randn_like(h)
    (y * dy + h * dh).sum().backward()
    xr = x.detach().clone().requires_grad_()
    rr = r.detach().clone().requires_grad_()
    h2 = xr + rr
    (ref_rms(h2, seq[2].weight.detach(), 1e-6) * dy + h2 * dh).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(r.grad, rr.grad)


def test_parameters_behave_like_nn_modules(rng):
    seq = ops.Sequential(ops.Linear(6, 10), ops.GELU(), ops.Linear(10, 6), ops.RMSNorm(6))
    keys = set(seq.state_dict())
    assert keys == {"0.weight", "0.bias", "2.weight", "2.bias", "3.weight"}
    x = torch.randn(3, 6, generator=rng)
    y0 = seq(x)
    opt = torch.optim.SGD(seq.parameters(), lr=0.1)
    (y0 * torch.randn_like(y0)).sum().backward()
    opt.step()
    y1 = seq(x)  # the cached program must see the updated parameters
    with torch.no_grad():
        ref = seq[3](seq[2](torch.nn.functional.gelu(seq[0](x))))
    torch.testing.assert_close(y1, ref)
    assert not torch.allclose(y0, y1)
    seq.to(torch.float64)
    y2 = seq(x.double())
    assert y2.dtype == torch.float64
    clone = ops.Sequential(ops.Linear(6, 10), ops.GELU(), ops.Linear(10, 6), ops.RMSNorm(6)).double()
    clone.load_state_dict(seq.state_dict())
    torch.testing.assert_close(clone(x.double()), y2)


def test_sequential_container_api():
    seq = ops.Sequential(ops.Linear(4, 4), ops.GELU())
    assert len(seq) == 2 and isinstance(seq[1], ops.GELU)
    seq.append(ops.RMSNorm(4))
    assert len(seq) == 3 and isinstance(seq[-1], ops.RMSNorm)
    head = seq[:2]
    assert isinstance(head, ops.Sequential) and len(head) == 2
    assert [op.kind for op in seq] == ["Linear", "GELU", "RMSNorm"]
    with pytest.raises(TypeError, match="element 3 is a torch.nn.modules.linear.Linear"):
        seq.append(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="expected an opfuse op"):
        ops.Sequential(ops.GELU(), torch.nn.ReLU())


def test_sequential_input_errors_name_the_op():
    seq = ops.Sequential(ops.Linear(8, 8), ops.AddExtraInput(), ops.RMSNorm(8))
    x = torch.randn(2, 8)
    with pytest.raises(OpInputError, match=r"expected 2 input\(s\): x \(extra inputs for 1:AddExtraInput\); got 1"):
        seq(x)
    with pytest.raises(OpInputError, match=r"op 1: AddExtraInput: extra input has shape \[2, 7\], expected \[2, 8\]"):
        seq(x, torch.randn(2, 7))
    with pytest.raises(OpInputError, match=r"extra input has dtype float16, expected float32"):
        seq(x, torch.randn(2, 8).half())
    with pytest.raises(OpInputError, match=r"extra input has device meta, expected cpu"):
        seq(x, torch.empty(2, 8, device="meta"))
    with pytest.raises(OpInputError, match=r"op 0: Linear\(in_features=8, out_features=8, bias=True\): BasicLinear\(in_features=8, out_features=8\): input has 9 features"):
        seq(torch.randn(2, 9), torch.randn(2, 8))
    with pytest.raises(OpInputError, match="input 1 is a list"):
        seq(x, [1.0])
    with pytest.raises(OpInputError, match="input dtype float64 differs from the parameter dtype float32"):
        seq(x.double(), x.double())
    with pytest.raises(OpInputError, match="expected a floating point dtype"):
        ops.Sequential(ops.GELU())(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(OpInputError, match="expected an even number"):
        ops.Sequential(ops.SwiGLU())(torch.randn(2, 3))


def test_constructor_errors():
    with pytest.raises(ValueError, match=r"parallel='col'; accepted: None, 'column', 'row'"):
        ops.Linear(4, 4, parallel="col")
    with pytest.raises(ValueError, match="sequence_parallel=True needs parallel"):
        ops.Linear(4, 4, sequence_parallel=True)
    with pytest.raises(ValueError, match="in_features=0"):
        ops.Linear(0, 4)
    with pytest.raises(ValueError, match="approximate='fast'"):
        ops.GELU("fast")
    with pytest.raises(ValueError, match="normalized_shape"):
        ops.RMSNorm((4, 4))
    with pytest.raises(ValueError, match="eps=-1"):
        ops.LayerNorm(4, eps=-1)


def test_parallel_linear_needs_process_group(monkeypatch):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this test process")
    with pytest.raises(Exception, match="init_process_group"):
        ops.Linear(4, 4, parallel="column")


def test_world1_parallel_linear_equals_plain(world1, rng):
    """With a one-rank group every parallel layout is the unsharded layer."""
    for parallel, sp in [("column", False), ("row", False), ("column", True), ("row", True)]:
        lin = ops.Linear(6, 4, parallel=parallel, sequence_parallel=sp)
        randomize_(lin, rng)
        x = torch.randn(3, 6, generator=rng)
        torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias)


def test_load_unsharded_world1(world1, rng):
    lin = ops.Linear(6, 4, parallel="row")
    w, b = torch.randn(4, 6, generator=rng), torch.randn(4, generator=rng)
    lin.load_unsharded(w, b)
    torch.testing.assert_close(lin.weight, w)
    with pytest.raises(ValueError, match=r"weight has shape \[6, 4\], expected \[4, 6\]"):
        lin.load_unsharded(w.T)
