"""``opfuse.graphed`` on CPU: argument validation, signature errors, and the buffer / autograd
plumbing through ``replay="eager"`` (the same static buffers, aliasing and lifetime rules as the
CUDA graphs, with the block re-run instead of a graph replay). The CUDA graphs themselves are
tested in ``tests/gpu/test_graphed.py``."""

import warnings

import pytest
import torch

import opfuse
from opfuse import ops
from opfuse.graphs import recorders
from opfuse.graphs.graphed import GraphCaptureError, GraphedModule, GraphSignatureError, graphed, mismatch
from opfuse.ops.base import OpInputError, TensorMeta

H, F, T = 16, 32, 4


def mlp(hidden=H, ffn=F, seed=0):
    torch.manual_seed(seed)
    block = ops.Sequential(ops.RMSNorm(hidden), ops.Linear(hidden, ffn), ops.GELU("tanh"), ops.Linear(ffn, hidden),
                           ops.AddExtraInput(), ops.MakeExtraOutput(), ops.RMSNorm(hidden))
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return block


def leaves(gen, tokens=T, hidden=H, grad=True):
    return [torch.randn(tokens, hidden, generator=gen).requires_grad_(grad) for _ in range(2)]


def eager_step(block, x, r, dy, dh):
    """Outputs and gradients (inputs, then parameters) of the block run eagerly."""
    x, r = x.detach().clone().requires_grad_(), r.detach().clone().requires_grad_()
    y, h = block(x, r)
    grads = torch.autograd.grad((y, h), [x, r] + list(block.parameters()), (dy, dh))
    return (y.detach(), h.detach()), grads


# Validation -------------------------------------------------------------------------------------------


def test_arguments_are_validated():
    block = mlp()
    x, r = torch.randn(T, H), torch.randn(T, H)
    with pytest.raises(TypeError, match="expected an nn.Module"):
        graphed(lambda a, b: a, x, r, replay="eager")
    with pytest.raises(OpInputError, match="no inputs"):
        graphed(block, replay="eager")
    with pytest.raises(OpInputError, match="input 1 is a float"):
        graphed(block, x, 1.0, replay="eager")
    with pytest.raises(ValueError, match="replay='cuda'; accepted: 'cuda_graph', 'eager'"):
        graphed(block, x, r, replay="cuda")
    with pytest.raises(ValueError, match="backward='yes'"):
        graphed(block, x, r, backward="yes", replay="eager")
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="warmup="):
            graphed(block, x, r, warmup=bad, replay="eager")
    with pytest.raises(OpInputError, match="expected 2 input"):
        graphed(block, x, replay="eager")  # Sequential's own input check
    with pytest.raises(OpInputError, match="backward=True, but no input or parameter requires grad"):
        frozen = mlp().requires_grad_(False)
        graphed(frozen, x, r, backward=True, replay="eager")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_graphs_need_cuda():
    with pytest.raises(OpInputError, match="CUDA graphs need a CUDA device.*replay='eager'"):
        graphed(mlp(), torch.randn(T, H), torch.randn(T, H))


def test_mismatch_sentences():
    def meta(shape, dtype=torch.float32, grad=False):
        return TensorMeta(tuple(shape), dtype, torch.device("cpu"), grad)

    want = [meta((4, 16)), meta((4, 16), grad=True)]
    assert mismatch(want, list(want), check_grad=True) is None
    assert mismatch(want, [meta((4, 16))], check_grad=False) == "1 input(s) given, the captured graph takes 2"
    assert mismatch(want, [meta((4, 16)), meta((5, 16))], check_grad=False) == \
        "input 1 has shape [5, 16], the captured graph expects [4, 16]"
    assert mismatch(want, [meta((4, 16), torch.float16), want[1]], check_grad=False) == \
        "input 0 has dtype torch.float16, the captured graph expects torch.float32"
    assert mismatch(want, [meta((4, 16)), meta((4, 16))], check_grad=False) is None
    assert "requires_grad=False, the captured graph was recorded with requires_grad=True" in \
        mismatch(want, [meta((4, 16)), meta((4, 16))], check_grad=True)


# Replays (eager stand-in) -------------------------------------------------------------------------------


def test_training_replays_equal_eager_with_optimizer_steps_between():
    block = mlp()
    gen = torch.Generator().manual_seed(1)
    step = graphed(block, *leaves(gen), replay="eager")
    assert isinstance(step, GraphedModule) and step.captures[0].training
    assert list(step.parameters()) == list(block.parameters())
    opt = torch.optim.SGD(block.parameters(), lr=0.05)
    for i in range(12):
        x, r = leaves(gen)
        dy, dh = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
        (ye, he), grads = eager_step(block, x, r, dy, dh)
        opt.zero_grad(set_to_none=True)
        y, h = step(x, r)
        torch.autograd.backward((y, h), (dy, dh))
        for got, want in zip([y, h, x.grad, r.grad] + [p.grad for p in block.parameters()], [ye, he] + list(grads)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        before = [p.detach().clone() for p in block.parameters()]
        opt.step()  # in place: the next replay must read the new values
        assert all(not torch.equal(a, b) for a, b in zip(before, block.parameters()))


def test_inference_capture():
    block = mlp()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        step = graphed(block, *leaves(gen, grad=False), replay="eager")
        assert not step.captures[0].training
        for _ in range(3):
            x, r = leaves(gen, grad=False)
            y, h = step(x, r)
            ye, he = block(x, r)
            torch.testing.assert_close(y, ye, rtol=0, atol=0)
            torch.testing.assert_close(h, he, rtol=0, atol=0)
    x, r = leaves(gen, grad=False)
    with pytest.raises(GraphSignatureError, match="captured without backward .* torch.no_grad"):
        step(x, r)  # gradients enabled and the parameters require grad


def test_training_capture_runs_forward_only_under_no_grad():
    block = mlp()
    gen = torch.Generator().manual_seed(3)
    step = graphed(block, *leaves(gen), replay="eager")
    x, r = leaves(gen, grad=False)
    with torch.no_grad():
        y, h = step(x, r)
        ye, _ = block(x, r)
    assert not y.requires_grad
    torch.testing.assert_close(y, ye, rtol=1e-6, atol=1e-6)


def test_outputs_are_static_unless_cloned():
    gen = torch.Generator().manual_seed(4)
    block = mlp()
    with torch.no_grad():
        step = graphed(block, *leaves(gen, grad=False), replay="eager")
        y1, _ = step(*leaves(gen, grad=False))
        first = y1.clone()
        y2, _ = step(*leaves(gen, grad=False))
        assert y1.data_ptr() == y2.data_ptr() and torch.equal(y1, y2) and not torch.equal(y1, first)
        cloning = graphed(block, *leaves(gen, grad=False), clone_outputs=True, replay="eager")
        c1, _ = cloning(*leaves(gen, grad=False))
        kept = c1.clone()
        cloning(*leaves(gen, grad=False))
        assert torch.equal(c1, kept)


def test_static_inputs_can_be_written_in_place():
    gen = torch.Generator().manual_seed(5)
    block = mlp()
    with torch.no_grad():
        step = graphed(block, *leaves(gen, grad=False), replay="eager")
        x, r = leaves(gen, grad=False)
        for static, value in zip(step.static_inputs, (x, r)):
            static.copy_(value)
        y, _ = step(*step.static_inputs)
        torch.testing.assert_close(y, block(x, r)[0], rtol=0, atol=0)


def test_gradients_accumulate_without_zero_grad():
    """Returned gradients alias static buffers (autograd adopts them as .grad without a copy); a
    second backward must add to them, not double the new gradient."""
    block = mlp()
    gen = torch.Generator().manual_seed(6)
    step = graphed(block, *leaves(gen), replay="eager")
    x, r = leaves(gen)
    grads = []
    for _ in range(2):
        dy, dh = torch.randn(T, H, generator=gen), torch.randn(T, H, generator=gen)
        grads.append(eager_step(block, x, r, dy, dh)[1])
        y, h = step(x, r)
        torch.autograd.backward((y, h), (dy, dh))
    for got, a, b in zip([x.grad, r.grad] + [p.grad for p in block.parameters()], *grads):
        torch.testing.assert_close(got, a + b, rtol=1e-5, atol=1e-6)


def test_backward_after_a_newer_forward_raises():
    block = mlp()
    gen = torch.Generator().manual_seed(7)
    step = graphed(block, *leaves(gen), replay="eager")
    y1, _ = step(*leaves(gen))
    y2, _ = step(*leaves(gen))
    with pytest.raises(RuntimeError, match="replayed its forward 1 more time"):
        y1.sum().backward()
    y2.sum().backward()  # the newest call is fine


def test_signature_change_error_names_both_signatures():
    block = mlp()
    gen = torch.Generator().manual_seed(8)
    step = graphed(block, *leaves(gen), replay="eager")
    with pytest.raises(GraphSignatureError) as info:
        step(*leaves(gen, tokens=T + 3))
    text = str(info.value)
    assert "input 0 has shape [7, 16], the captured graph expects [4, 16]" in text
    assert "float32[4, 16]@cpu (requires grad), float32[4, 16]@cpu (requires grad)" in text
    assert "received: (float32[7, 16]@cpu (requires grad)" in text and "recapture=True" in text
    with pytest.raises(GraphSignatureError, match="input 1 has dtype torch.float64"):
        x, r = leaves(gen)
        step(x, r.double())
    with pytest.raises(GraphSignatureError, match="1 input"):
        step(leaves(gen)[0])
    with pytest.raises(OpInputError, match="input 1 is a str"):
        step(leaves(gen)[0], "r")
    with pytest.raises(GraphSignatureError, match="input 0 has requires_grad=False"):
        step(torch.randn(T, H), leaves(gen)[1])
    block[1].weight.requires_grad_(False)
    with pytest.raises(GraphSignatureError, match="parameter 1 has requires_grad=False"):
        step(*leaves(gen))


def test_recapture_records_one_graph_per_signature():
    block = mlp()
    gen = torch.Generator().manual_seed(9)
    step = graphed(block, *leaves(gen), recapture=True, replay="eager")
    for tokens in (4, 9, 4, 9, 1):
        x, r = leaves(gen, tokens=tokens)
        dy, dh = torch.randn(tokens, H, generator=gen), torch.randn(tokens, H, generator=gen)
        (ye, he), grads = eager_step(block, x, r, dy, dh)
        y, h = step(x, r)
        torch.autograd.backward((y, h), (dy, dh))
        torch.testing.assert_close(y, ye, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x.grad, grads[0], rtol=1e-6, atol=1e-6)
        block.zero_grad(set_to_none=True)
    assert sorted(c.metas[0].shape[0] for c in step.captures) == [1, 4, 9]
    assert "recapture" not in repr(step) and "+backward" in repr(step)


def test_reallocated_parameter_is_copied_with_a_warning_and_a_new_shape_is_an_error():
    block = mlp()
    gen = torch.Generator().manual_seed(10)
    with torch.no_grad():
        step = graphed(block, *leaves(gen, grad=False), replay="eager")
        block[6].weight.data = block[6].weight.data * 2  # new storage
        x, r = leaves(gen, grad=False)
        with pytest.warns(UserWarning, match="parameter 5 .* re-allocated"):
            y, _ = step(x, r)
        torch.testing.assert_close(y, block(x, r)[0], rtol=0, atol=0)
        assert torch.equal(step.captures[0].param_storage[5], block[6].weight)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step(x, r)  # warned once
        block[6].weight.data = torch.ones(H + 1)
        with pytest.raises(GraphSignatureError, match=r"parameter 5 is now float32\[17\]"):
            step(x, r)


def test_frozen_parameters_get_no_gradient():
    block = mlp()
    block[1].requires_grad_(False)
    gen = torch.Generator().manual_seed(11)
    step = graphed(block, *leaves(gen), replay="eager")
    y, h = step(*leaves(gen))
    (y.sum() + h.sum()).backward()
    assert block[1].weight.grad is None and block[3].weight.grad is not None


def test_single_output_block_returns_a_tensor():
    block = ops.Sequential(ops.Linear(H, F), ops.GELU())
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(T, H, generator=gen, requires_grad=True)
    step = graphed(block, x, replay="eager")
    y = step(x)
    assert isinstance(y, torch.Tensor) and y.shape == (T, F)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.autograd.grad(block(x).sum(), x)[0], rtol=1e-6, atol=1e-6)


def test_a_program_compiled_during_capture_is_an_error(monkeypatch):
    """What a CUDA-graph capture refuses (a capability check inside a capture may fall back):
    forced here with the eager stand-in by changing a setting between warm-up and capture."""
    monkeypatch.setattr(recorders.make_replayer("eager", torch.device("cpu")).__class__, "strict_programs", True)
    block = mlp()
    calls = []

    class Bumping(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, x, r):
            calls.append(1)
            if len(calls) == 3:  # after the warm-up's two runs: the capture
                opfuse.config.verify = not opfuse.config.verify  # another setting: a cache miss
            return self.block(x, r)

    gen = torch.Generator().manual_seed(13)
    with opfuse.config.override(verify=True), torch.no_grad(), \
            pytest.raises(GraphCaptureError, match="a program was compiled during capture"):
        graphed(Bumping(), *leaves(gen, grad=False), warmup=2, replay="eager")
