"""Fusions that only their reference implementation could run are left to Inductor in the graphs
it compiles (opfuse/torch_compile/reference_fusions.py): on CUDA by default, on every device with
``reference_fusions="inductor"`` (how these CPU tests make the decision happen), never with
``keep``; the graph then computes what eager does, and ``explain()`` says which and why."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opfuse

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Block(nn.Module):
    """A residual add + RMSNorm whose output feeds merged q/k projections (their reference is one
    GEMM: always fused), then a second add + RMSNorm (reading the first's new residual), then a
    biased GEMM + GELU."""

    def __init__(self, hidden=16):
        super().__init__()
        self.q, self.k = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x, residual):
        residual = residual + x
        h = self.norm1(residual)
        residual = residual + torch.tanh(self.q(h)) * self.k(h)
        h = self.norm2(residual)
        return self.down(F.gelu(self.up(h))), residual


def _rules(compiled):
    return sorted(f.rule for program in opfuse.programs(compiled) for f in program.fusions)


def _check(setting, train, options):
    torch.manual_seed(0)
    model = Block()
    eager = copy.deepcopy(model)
    x, residual = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    with opfuse.config.override(reference_fusions=setting):
        compiled = opfuse.optimize(model, options=options)
        inputs = [t.clone().requires_grad_(train) for t in (x, residual)]
        with torch.set_grad_enabled(train):
            got = compiled(*inputs)
    want_inputs = [t.clone().requires_grad_(train) for t in (x, residual)]
    with torch.set_grad_enabled(train):
        want = eager(*want_inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    if train:
        sum(t.sum() for t in got).backward()
        sum(t.sum() for t in want).backward()
        for a, b in zip(inputs + list(model.parameters()), want_inputs + list(eager.parameters())):
            torch.testing.assert_close(a.grad, b.grad, atol=2e-5, rtol=2e-5)
    return compiled


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_reference_only_fusions_are_left_to_inductor(train):
    compiled = _check("inductor", train, {})
    rules = _rules(compiled)
    assert "horizontal_gemm" in rules, rules  # one GEMM for two: worth it whatever runs it
    assert "add_rmsnorm" not in rules and "linear_bias_activation" not in rules, rules
    text = "\n".join(p.explain() for p in opfuse.programs(compiled))
    assert "add_rmsnorm left to Inductor: only its reference implementation can run it here" in text, text


def test_without_inductor_or_with_keep_they_are_made():
    """No Inductor (the fused graph runs eagerly): nothing would fuse the ops, so the fusions stay;
    ``keep`` keeps them under Inductor too; ``auto`` leaves them only on CUDA devices."""
    assert _rules(_check("inductor", False, {"inductor": False})).count("add_rmsnorm") == 2
    torch._dynamo.reset()
    assert _rules(_check("keep", False, {})).count("add_rmsnorm") == 2
    torch._dynamo.reset()
    assert _rules(_check("auto", False, {})).count("add_rmsnorm") == 2  # CPU tensors


def test_the_setting_names_its_values():
    with pytest.raises(ValueError, match="reference_fusions.*'auto', 'inductor', 'keep'"):
        opfuse.config.reference_fusions = "sometimes"


@pytest.mark.parametrize("setting,device,slower,left", [
    ("auto", "cuda", False, True), ("auto", "cpu", False, False), ("inductor", "cpu", False, True),
    ("keep", "cuda", False, False),
    # A fused op whose reference does worse than the graph on any device (a gather in line):
    ("auto", "cpu", True, True), ("keep", "cpu", True, False)])
def test_which_devices_each_setting_leaves_to_inductor(setting, device, slower, left):
    from opfuse.torch_compile.reference_fusions import _applies

    with opfuse.config.override(reference_fusions=setting):
        assert _applies(torch.device(device), slower) is left


def test_a_forced_reference_runs_as_asked():
    with opfuse.config.override(force_impl="add_rmsnorm=reference"):
        compiled = _check("inductor", False, {})
    assert _rules(compiled).count("add_rmsnorm") == 2


@pytest.fixture
def add_norm_kernel_on_cpu():
    """``add_rmsnorm``'s ``cuda`` implementation made capable on this CPU host (the reference's
    functions standing in for the kernels), so that a non-reference implementation is chosen."""
    import dataclasses

    from opfuse.families.residual_norm.implementations import TABLE
    from opfuse.machinery.implementation import always

    impls = TABLE._table["add_rmsnorm"]
    cuda, reference = impls[0], impls[-1]
    assert cuda.name == "cuda" and reference.name == "reference"
    impls[0] = dataclasses.replace(cuda, check=always, forward=reference.forward, backward=reference.backward)
    try:
        yield
    finally:
        impls[0] = cuda


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_an_add_norm_inductor_fuses_alike_is_left_whatever_runs_it(add_norm_kernel_on_cpu, train):
    """A standalone add + RMSNorm is left to Inductor even where its own kernel could run it: Inductor
    fuses the same ops into one kernel, and the custom op only adds host time per call."""
    compiled = _check("inductor", train, {})
    rules = _rules(compiled)
    assert "add_rmsnorm" not in rules and "horizontal_gemm" in rules, rules
    text = "\n".join(p.explain() for p in opfuse.programs(compiled))
    assert "add_rmsnorm left to Inductor: it fuses these ops into one kernel itself, as fast as the cuda kernel" \
        in text, text
    torch._dynamo.reset()
    kept = _check("keep", train, {})
    assert [f.impl for p in opfuse.programs(kept) for f in p.fusions if f.rule == "add_rmsnorm"] == ["cuda", "cuda"]


def test_a_forced_kernel_runs_as_asked(add_norm_kernel_on_cpu):
    with opfuse.config.override(force_impl="add_rmsnorm=cuda"):
        compiled = _check("inductor", False, {})
    assert _rules(compiled).count("add_rmsnorm") == 2
