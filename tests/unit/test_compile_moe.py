"""Mixture-of-experts layers written as Hugging Face writes them (examples/hf_moe.py: Mixtral's and
Qwen2-MoE's blocks, 8 experts, top-2), through ``opfuse.optimize``: the per-expert loop becomes
two grouped GEMMs with the group sizes on the device (one graph, no break, no host sync), outputs
and gradients equal the Hugging Face code run eagerly, the parameters and ``state_dict`` stay the
same; blocks the rewrite cannot reproduce are left alone and explain() says why; under FP8 the
grouped GEMMs run the recipe's grouped FP8 GEMM (compared with its emulation); the all-reduce
after an MoE block's combine fuses with the residual add and the next norm through the reshape.
"""

import copy
import os
import sys

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

import opfuse
from opfuse import fp8
from opfuse.ops.grouped import BasicGroupedLinear
from opfuse.torch_compile import moe as moe_rewrite
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))
from hf_moe import MixtralSparseMoeBlock, MoEDecoder, Qwen2MoeSparseMoeBlock  # noqa: E402

EAGER = {"inductor": False}
BLOCKS = [MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def relative(got, want):
    """max |got - want| / max |want| (the difference itself where ``want`` is all zeros)."""
    scale = want.float().abs().max().clamp_min(1e-30) if want.abs().max() > 0 else 1.0
    return ((got.float() - want.float()).abs().max() / scale).item()


def grads(model, x, y, seed=5):
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)))
    # Experts that no token chose: Hugging Face's loop leaves their gradient None, the grouped
    # GEMM gives zeros.
    return [x.grad] + [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def rules(programs):
    return sorted(f.rule for p in programs for f in p.fusions)


@pytest.mark.parametrize("block", BLOCKS, ids=["mixtral", "qwen2moe"])
def test_hf_blocks_become_grouped_gemms_and_match_eager(block):
    torch.manual_seed(0)
    model = MoEDecoder(block)
    reference = copy.deepcopy(model)
    params = list(model.parameters())
    keys = list(model.state_dict())
    compiled = opfuse.optimize(model, options=EAGER)
    x = torch.randn(2, 6, 32, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, want = compiled(x), reference(xr)
    assert relative(y, want) < 1e-5
    for got, ref in zip(grads(model, x, y), grads(reference, xr, want)):
        assert relative(got, ref) < 1e-5
    assert all(a is b for a, b in zip(model.parameters(), params)) and list(model.state_dict()) == keys
    (program,) = opfuse.programs(compiled)
    assert rules([program]).count("grouped_linear") == 4  # gate+up and down, two layers
    text = program.explain()
    assert f"blocks.0 ({block.__name__}) rewritten: 8 experts, top-2" in text, text
    assert "read as views of their storage (no copy)" in text


def test_the_rewritten_block_is_one_graph():
    """Hugging Face's loop graph-breaks on the data-dependent expert mask; the rewrite has static
    shapes throughout (fullgraph=True would raise on a break)."""
    torch.manual_seed(1)
    block = MixtralSparseMoeBlock()
    reference = copy.deepcopy(block)
    compiled = opfuse.optimize(block, fullgraph=True, options=EAGER)
    x = torch.randn(1, 7, 32)
    with torch.no_grad():
        out, logits = compiled(x)
        want, want_logits = reference(x)
    assert relative(out, want) < 1e-5 and torch.equal(logits, want_logits)


def test_blocks_the_rewrite_cannot_reproduce_are_left_alone():
    class Jittery(MixtralSparseMoeBlock):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.jitter_noise = 0.01

    class RenormalisesBeforeTopK(MixtralSparseMoeBlock):
        """A routing this rewrite does not reproduce: caught by the probe comparison."""

        def forward(self, hidden_states):
            out, logits = super().forward(hidden_states)
            return out * 2, logits

    model = nn.ModuleDict({"jitter": Jittery(), "other": RenormalisesBeforeTopK(), "plain": MixtralSparseMoeBlock()})
    prepared = opfuse.torch_compile.prepare_model(model)
    text = "\n".join(prepared.notes)
    assert "jitter (Jittery) not rewritten: router jitter noise" in text
    assert "other (RenormalisesBeforeTopK) not rewritten: its outputs differ from the grouped forward's" in text
    assert "plain (MixtralSparseMoeBlock) rewritten" in text
    assert "forward" not in model["other"].__dict__ and "forward" in model["plain"].__dict__
    again = opfuse.torch_compile.prepare_model(model)  # a second optimize of the same model
    assert "plain (MixtralSparseMoeBlock) rewritten" in "\n".join(again.notes)
    assert "plain.experts gate+up" in again.packed.labels
    untouched = MixtralSparseMoeBlock()
    opfuse.torch_compile.prepare_model(untouched, moe=False)
    assert "forward" not in untouched.__dict__


@pytest.mark.parametrize("recipe, options", [(fp8.TensorScaling(), EAGER), (fp8.RowwiseScaling(), EAGER),
                                             (fp8.TensorScaling(), {})], ids=["tensor", "row", "tensor-inductor"])
def test_fp8_grouped_gemms_match_the_recipes_emulation(recipe, options, monkeypatch):
    """With Inductor too: the grouped backward that the lowering swaps for the FP8 one must not keep
    the old op's ``eager_input_vals`` (Inductor's lowering asserted on them, 2x H200, session 5)."""
    torch.manual_seed(2)
    model = MoEDecoder(Qwen2MoeSparseMoeBlock)
    opfuse.torch_compile.prepare_model(model)
    reference = copy.deepcopy(model)
    compiled = opfuse.optimize(model, fp8=recipe, options=options)
    x = torch.randn(2, 5, 32, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y = compiled(x)
    got = grads(model, x, y)

    # The reference: the same rewritten model eagerly, every GEMM but the routers' emulated in FP8.
    def emulated_grouped(rows, sizes, weight):
        op = BasicGroupedLinear(weight.shape[0], weight.shape[2], weight.shape[1], weight=weight, recipe=recipe)
        return op(rows, sizes)

    for name, module in reference.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith(".gate"):
            module.forward = (lambda layer: lambda t: fp8.fp8_linear(t, layer.weight, layer.bias, recipe))(module)
    monkeypatch.setattr(moe_rewrite, "_grouped", emulated_grouped)
    want = reference(xr)
    for a, b in zip(got, grads(reference, xr, want)):
        assert relative(a, b) < 1e-5
    assert relative(y, want) < 1e-5
    (program,) = opfuse.programs(compiled)
    assert rules([program]).count("grouped_linear_fp8") == 4
    text = program.explain()
    assert "blocks.0.experts.*.gate_proj (grouped)" in text
    assert "blocks.0.gate (MoE router: routing stays in high precision)" in text


def test_the_all_reduce_after_a_combine_fuses_through_the_reshape(world1):
    """HF's MoE output under TP: the [tokens, hidden] combine all-reduced, reshaped to [batch, seq,
    hidden], then added to the residual: the all-reduce, add and norm are one op."""
    norm = nn.RMSNorm(16)

    def layer(x, residual):
        combined = x.reshape(-1, 16) * 2
        h = funcol.all_reduce(combined, "sum", world1).reshape(residual.shape) + residual
        return norm(h), h

    compiled = opfuse.optimize(layer, options=EAGER)
    x, r = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    with torch.no_grad():
        for got, want in zip(compiled(x, r), layer(x, r)):
            assert relative(got, want) < 1e-6
    assert rules(opfuse.programs(compiled)) == ["allreduce_add_rmsnorm"]


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_grouped_gemms_of_a_training_graph_are_chosen_for_training(grad, monkeypatch):
    """In a joint forward + backward graph the grouped GEMM's backward runs the implementation chosen
    for its forward, so the choice is a training one (the measured order differs: on H100/H200,
    ``torch_grouped_mm`` first for training, ``triton_persistent`` for the forward alone); without a
    backward it stays a forward-only choice."""
    from opfuse.families.grouped_linear import tuning

    seen = []
    real = tuning.measured_order
    monkeypatch.setattr(tuning, "measured_order", lambda spec, table=None: seen.append((spec.x.shape[0],
                                                                                         spec.requires_grad))
                        or real(spec, table))
    torch.manual_seed(0)
    model = MoEDecoder(MixtralSparseMoeBlock)
    compiled = opfuse.optimize(model, options=EAGER)
    x = torch.randn(2, 6, 32, requires_grad=grad)
    with torch.set_grad_enabled(grad):
        compiled(x)
    (program,) = opfuse.programs(compiled)
    assert program.kind == ("training" if grad else "inference")
    assert rules([program]).count("grouped_linear") == 4
    # the rows of this input (12 tokens, top-2); the rewrite's own check of the block runs others
    chosen = {want for rows, want in seen if rows == 24}
    assert chosen == {grad}, seen
    # the backend's pipeline chose after tracing (4 grouped GEMMs), as for training when there is a backward
    assert sum(rows == 24 for rows, _ in seen) >= 4


def _loop_experts(x, weights, selected, gate_up, down, act):
    """The per-expert loop in float64: each token's rows through its experts, weighted and summed."""
    ffn = gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(selected.shape[1]):
            e = selected[t, j]
            h = gate_up[e] @ x[t]
            out[t] += weights[t, j] * (down[e] @ (act(h[:ffn]) * h[ffn:]))
    return out


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_grouped_experts_forward_and_gradients_match_the_loop_in_float64(top_k):
    """The grouped formulation (tokens spread to expert order and collected back by gathers, both
    ways in the backward) against the per-expert loop, outputs and every gradient, in float64;
    one expert gets no token."""
    g = torch.Generator().manual_seed(top_k)
    tokens, hidden, ffn, experts = 7, 6, 5, 4
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(tokens, top_k, generator=g, dtype=torch.float64, requires_grad=True)
    selected = torch.stack([torch.randperm(experts - 1, generator=g)[:top_k] for _ in range(tokens)])
    gate_up = torch.randn(experts, 2 * ffn, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    down = torch.randn(experts, hidden, ffn, generator=g, dtype=torch.float64, requires_grad=True)
    act = torch.nn.functional.silu
    got = moe_rewrite.grouped_experts(x, weights, selected, gate_up, down, act)
    want = _loop_experts(x, weights, selected, gate_up, down, act)
    torch.testing.assert_close(got, want)
    dy = torch.randn(got.shape, generator=g, dtype=torch.float64)
    inputs = (x, weights, gate_up, down)
    for a, b in zip(torch.autograd.grad(got, inputs, dy), torch.autograd.grad(want, inputs, dy)):
        torch.testing.assert_close(a, b)


def test_tokens_move_by_gathers_in_the_compiled_forward_and_backward():
    """No scatter-add of activation rows in the traced forward or backward (autograd's index_add /
    index_put with accumulate, which Inductor leaves to ATen's atomic kernel for 16-bit types);
    the only scatter left is the group-size count over integers."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 8, generator=g, dtype=torch.bfloat16, requires_grad=True)
    weights = torch.rand(12, 2, generator=g, dtype=torch.bfloat16, requires_grad=True)
    selected = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(12)])
    gate_up = torch.randn(4, 10, 8, generator=g, dtype=torch.bfloat16, requires_grad=True)
    down = torch.randn(4, 8, 5, generator=g, dtype=torch.bfloat16, requires_grad=True)
    fn = torch.compile(moe_rewrite.grouped_experts, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep),
                       fullgraph=True)
    fn(x, weights, selected, gate_up, down, torch.nn.functional.silu).sum().backward()
    assert len(graphs) == 2 and x.grad is not None
    aten = torch.ops.aten
    scatters = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function" and n.target in (
        aten.index_add.default, aten.index_add_.default, aten.index_put.default, aten.index_put_.default,
        aten._unsafe_index_put.default, aten.scatter_add.default, aten.scatter_reduce.two)]
    floating = [n for n in scatters if n.meta["val"].dtype.is_floating_point]
    assert not floating, [str(n.format_node()) for n in floating]
