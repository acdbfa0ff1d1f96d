"""FP8 through the torch.compile backend on one rank: ``opfuse.optimize(model, fp8=recipe)`` and
``torch.compile(model, backend="opfuse", options={"fp8": recipe})`` against the recipe's
reference (the same model with every ``nn.Linear`` replaced by :func:`opfuse.fp8.fp8_linear`, the
float32 emulation the FP8 kernels are tested against), outputs and gradients; which FP8 fusions
fire (the quantization fused into the norm, the FP8 all-gather and reduce-scatter GEMMs); what
explain() says; the layers ``fp8_filter`` keeps in high precision; errors.

Graphs run with ``options={"inductor": False}`` except one test compiled by Inductor.
"""

import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opfuse
from ..collectives_compat import all_gather, reduce_scatter
from opfuse import fp8

EAGER = {"inductor": False}
RECIPES = [fp8.TensorScaling(), fp8.RowwiseScaling()]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Norm(nn.Module):
    """Hugging Face Llama's RMSNorm."""

    def __init__(self, hidden, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(hidden, dtype=dtype))

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


def torch_norm(hidden, dtype):
    norm = nn.RMSNorm(hidden, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn_like(norm.weight))
    return norm


class Block(nn.Module):
    """norm -> q, k, v (one input) -> o, + residual -> norm -> gate/up (SwiGLU) -> down, + residual;
    then the output head."""

    def __init__(self, hidden=32, ffn=64, vocab=48, dtype=torch.float32, norm=Norm):
        super().__init__()
        self.attention_norm, self.ffn_norm, self.norm = norm(hidden, dtype), norm(hidden, dtype), norm(hidden, dtype)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden, bias=False, dtype=dtype) for _ in range(3))
        self.o = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.gate, self.up = nn.Linear(hidden, ffn, bias=False, dtype=dtype), nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.down = nn.Linear(ffn, hidden, bias=False, dtype=dtype)
        self.output = nn.Linear(hidden, vocab, bias=False, dtype=dtype)

    def forward(self, x):
        h = self.attention_norm(x)
        h = x + self.o(torch.tanh(self.q(h)) * self.k(h) + self.v(h))
        f = self.ffn_norm(h)
        h = h + self.down(F.silu(self.gate(f)) * self.up(f))
        return self.output(self.norm(h))


def emulated(model, recipe, keep=lambda name: True):
    """``model`` with every kept ``nn.Linear`` running the recipe's float32 emulation (in place)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and keep(name):
            module.forward = (lambda layer: lambda x: fp8.fp8_linear(x, layer.weight, layer.bias, recipe))(module)
    return model


def relative(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def run_both(make, recipe, x, keep=lambda name: True, train=True, options=EAGER, **kwargs):
    """``(compiled FP8 outputs and gradients, reference's, programs)`` of two copies of ``make()``."""
    torch.manual_seed(0)
    model = make()
    torch.manual_seed(0)
    reference = emulated(make(), recipe, keep)
    compiled = opfuse.optimize(model, fp8=recipe, options=options, **kwargs)
    results = []
    for module in (compiled, reference):
        xi = x.detach().clone().requires_grad_(train)
        with torch.set_grad_enabled(train):
            y = module(xi)
        grads = []
        if train:
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y.dtype))
            grads = [xi.grad] + [p.grad for p in (model if module is compiled else reference).parameters()]
        results.append((y, grads))
    return results[0], results[1], opfuse.programs(compiled)


def rules(programs, phase=None):
    return sorted(f.rule for p in programs for f in (p.fusions_in(phase) if phase else p.fusions))


@pytest.mark.parametrize("recipe", RECIPES, ids=["tensor", "row"])
def test_training_matches_the_recipes_emulation_and_fuses_the_quantization(world1, recipe):
    x = torch.randn(2, 5, 32)
    (y, grads), (want, want_grads), programs = run_both(Block, recipe, x, merge_projections=False)
    assert relative(y, want) < 1e-5
    for got, ref in zip(grads, want_grads):
        assert relative(got, ref) < 1e-5
    # FP8 really ran: the high-precision model differs by FP8 rounding.
    torch.manual_seed(0)
    assert relative(y, Block()(x)) > 1e-3
    found = rules(programs, "forward")
    # attention_norm and ffn_norm emit FP8 once for q/k/v and gate/up; the final norm for the head.
    assert found.count("add_rmsnorm_quantize") == 3, programs[0].explain()
    assert found.count("fp8_linear") == 8
    text = programs[0].explain()
    assert "8 projection GEMM(s) in FP8, forward and backward: q, k, v, o, gate, up, down, output" in text
    assert "FP8 without CUDA graphs: every FP8 GEMM adds quantization kernels the host launches" in text


def test_backward_gemms_are_fp8_and_keep_one_byte_inputs(world1, tmp_path):
    with opfuse.config.override(dump_dir=str(tmp_path)):
        run_both(Block, fp8.TensorScaling(), torch.randn(2, 5, 32), merge_projections=False)
    (folder,) = os.listdir(tmp_path)
    after = (tmp_path / folder / "aten_after.py").read_text()
    assert after.count("opfuse.fp8_linear_backward") == 8
    assert "opfuse.compiled_norm_quantize" in after and "opfuse.compiled_fp8_gemm" in after
    # No high-precision GEMM is left: attention's products here are elementwise.
    assert "aten.mm.default" not in after and "aten.addmm" not in after
    # Past autograd, every opfuse op is called through its direct overload (no custom-op layers).
    calls = re.findall(r"torch\.ops\.opfuse\.(\w+)\.(\w+)\(", after)
    assert calls and all(overload == "direct" for _, overload in calls), sorted(set(calls))


def test_inference_graph(world1):
    x = torch.randn(3, 32)
    (y, _), (want, _), programs = run_both(Block, fp8.TensorScaling(), x, train=False)
    assert relative(y, want) < 1e-5
    assert programs[0].kind == "inference"
    assert "add_rmsnorm_quantize" in rules(programs)


def test_fp8_filter_keeps_the_head_in_high_precision(world1):
    seen = []

    def keep(fqn, module):
        seen.append((fqn, type(module).__name__))
        return fqn != "output"

    x = torch.randn(2, 4, 32)
    (y, grads), (want, want_grads), programs = run_both(Block, fp8.TensorScaling(), x,
                                                         keep=lambda name: name != "output", fp8_filter=keep)
    assert relative(y, want) < 1e-5
    for got, ref in zip(grads, want_grads):
        assert relative(got, ref) < 1e-5
    assert ("output", "Linear") in seen and ("q", "Linear") in seen
    text = programs[0].explain()
    assert "kept in high precision: output (fp8_filter)" in text, text
    assert rules(programs).count("fp8_linear") == 7


def test_torch_compile_with_the_backend_name_and_options(world1):
    torch.manual_seed(0)
    model = Block()
    torch.manual_seed(0)
    reference = emulated(Block(), fp8.RowwiseScaling(), keep=lambda name: name != "output")
    compiled = torch.compile(model, backend="opfuse", options={"inductor": False, "fp8": fp8.RowwiseScaling(),
                                                               "fp8_filter": lambda fqn, m: fqn != "output"})
    x = torch.randn(2, 4, 32)
    with torch.no_grad():
        assert relative(compiled(x), reference(x)) < 1e-5
    program = opfuse.programs(compiled)[-1]
    assert "output (fp8_filter)" in program.explain()


class SequenceParallel(nn.Module):
    """Megatron sequence parallelism by hand: norm, all-gather of tokens, column GEMM, GELU, row
    GEMM, reduce-scatter of tokens, + residual."""

    def __init__(self, group, hidden=32, ffn=64):
        super().__init__()
        self.group = group
        self.norm = Norm(hidden)
        self.up, self.down = nn.Linear(hidden, ffn, bias=False), nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        gathered = all_gather(self.norm(x), 0, self.group)
        return x + reduce_scatter(self.down(F.gelu(self.up(gathered))), "sum", 0, self.group)


@pytest.mark.parametrize("recipe", RECIPES, ids=["tensor", "row"])
def test_sequence_parallel_gathers_fp8_and_scatters_after_the_fp8_gemm(world1, recipe):
    x = torch.randn(8, 32)
    (y, grads), (want, want_grads), programs = run_both(lambda: SequenceParallel(world1), recipe, x)
    assert relative(y, want) < 1e-5
    for got, ref in zip(grads, want_grads):
        assert relative(got, ref) < 1e-5
    found = rules(programs, "forward")
    assert {"add_rmsnorm_quantize", "all_gather_linear_fp8", "linear_reduce_scatter_fp8"} <= set(found), found


class GatheredThroughAView(nn.Module):
    """DTensor-style sequence parallelism: ``[1, S/world, H]`` shards gathered along the sequence
    dim, the ``[1, S, H]`` result reshaped to ``[S, H]`` and read by q, k and v (several GEMMs: no
    GEMM fuses with the gather); ``also_bf16`` adds a reader of the gathered value that is not a
    GEMM."""

    def __init__(self, group, also_bf16: bool, hidden=32):
        super().__init__()
        self.group, self.also_bf16 = group, also_bf16
        self.norm = Norm(hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden, bias=False) for _ in range(3))
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        gathered = all_gather(self.norm(x), 1, self.group).reshape(-1, x.shape[-1])
        h = torch.tanh(self.q(gathered)) * self.k(gathered) + self.v(gathered)
        if self.also_bf16:
            h = h + gathered.sin()
        return x + reduce_scatter(self.o(h), "sum", 0, self.group).reshape(x.shape)


@pytest.mark.parametrize("recipe", RECIPES, ids=["tensor", "row"])
@pytest.mark.parametrize("also_bf16", [False, True], ids=["gemms-only", "other-reader"])
def test_gemms_reading_a_gather_through_a_view_get_fp8_gathered(world1, recipe, also_bf16):
    """Where only FP8 GEMMs read the gathered activation (through a token reshape), the
    quantization moves above the gather into the norm (``add_rmsnorm_quantize``: the gather moves
    FP8 bytes); where another op reads it too, it stays after the gather (a ``quantize`` op), and
    the values are the recipe's either way."""
    x = torch.randn(1, 8, 32)
    (y, grads), (want, want_grads), programs = run_both(lambda: GatheredThroughAView(world1, also_bf16), recipe, x)
    assert relative(y, want) < 1e-5
    for got, ref in zip(grads, want_grads):
        assert relative(got, ref) < 1e-5
    found = rules(programs, "forward")
    if also_bf16:
        assert "quantize" in found and "add_rmsnorm_quantize" not in found, found
    else:
        assert "add_rmsnorm_quantize" in found and "quantize" not in found, found
        assert found.count("fp8_linear") == 3, found


def test_bfloat16_model(world1):
    make = lambda: Block(dtype=torch.bfloat16, norm=torch_norm)  # noqa: E731
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    (y, grads), (want, want_grads), programs = run_both(make, fp8.TensorScaling(), x)
    assert "add_rmsnorm_quantize" in rules(programs)
    # bfloat16 sums in another order here and there (the residual adds of the fused norms)
    assert relative(y, want) < 2e-2
    for got, ref in zip(grads, want_grads):
        assert relative(got, ref) < 2e-2


def test_inductor_compiles_the_fp8_graph(world1):
    recipe = fp8.TensorScaling()
    torch.manual_seed(0)
    model = nn.Sequential(Norm(32), nn.Linear(32, 64, bias=False), nn.GELU(), nn.Linear(64, 32, bias=False))
    torch.manual_seed(0)
    reference = emulated(nn.Sequential(Norm(32), nn.Linear(32, 64, bias=False), nn.GELU(),
                                       nn.Linear(64, 32, bias=False)), recipe)
    compiled = opfuse.optimize(model, fp8=recipe)
    x = torch.randn(4, 32, requires_grad=True)
    y = compiled(x)
    (gx,) = torch.autograd.grad(y.sum(), x)
    xr = x.detach().requires_grad_()
    want = reference(xr)
    (wx,) = torch.autograd.grad(want.sum(), xr)
    assert relative(y, want) < 1e-5 and relative(gx, wx) < 1e-5
    assert "add_rmsnorm_quantize" in rules(opfuse.programs(compiled))


def test_no_recognised_linear_is_explained(world1):
    compiled = opfuse.optimize(lambda x: torch.relu(x) * 2, fp8=fp8.TensorScaling(), options=EAGER)
    with torch.no_grad():
        compiled(torch.randn(4, 8))
    assert "no projection GEMM" in opfuse.programs(compiled)[0].explain()


def test_misuse_is_refused_with_what_is_accepted(world1):
    model = Block()
    with pytest.raises(TypeError, match="expected an opfuse.fp8 recipe: opfuse.fp8.TensorScaling"):
        opfuse.optimize(model, fp8="tensor")
    with pytest.raises(ValueError, match="without an FP8 recipe"):
        opfuse.optimize(model, fp8_filter=lambda fqn, m: True)
    with pytest.raises(TypeError, match="expected a function"):
        opfuse.optimize(model, fp8=fp8.TensorScaling(), fp8_filter="output")
    compiled = opfuse.optimize(model, fp8=fp8.TensorScaling(), fp8_filter=lambda fqn, m: "yes", options=EAGER)
    with pytest.raises(Exception, match="expected True .FP8. or False"):
        compiled(torch.randn(2, 32))
    compiled = torch.compile(model, backend="opfuse", options={"inductor": False, "fp8": "row"})
    with pytest.raises(Exception, match="options\\['fp8'\\]='row'"):
        compiled(torch.randn(2, 32))


def test_fp8_backward_of_an_input_without_grad_returns_distinct_placeholders():
    """The first layer's input needs no gradient: the FP8 backward returns placeholders for what
    nobody asked for, which must not be one tensor returned twice (torch refuses aliased outputs
    of a custom op run through the dispatcher, as the compile front end runs it)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    fast = opfuse.optimize(mlp, fp8=opfuse.fp8.TensorScaling(), options={"inductor": False})
    fast(torch.randn(8, 64)).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mlp.parameters())


def test_forward_and_backward_gemms_get_the_parameter_itself(world1):
    """The FP8 copies of a weight are cached per parameter (and version): the forward quantizes
    W and W.T in one pass, the backward's data gradient reuses W.T. That only works when the
    compiled forward hands the GEMM the parameter itself (not an alias carrying the "trained"
    flag, which would be a new tensor and a cache miss on every call). A stand-in implementation
    placed before the reference records what each GEMM was given."""
    from opfuse.families.linear.implementations import TABLE
    from opfuse.families.linear.fp8 import reference
    from opfuse.fp8.state import weight_trained
    from opfuse.machinery.implementation import Implementation, always

    seen = {"forward": [], "backward": []}

    def forward(x, x_data, x_scale, weight, bias, recipe):
        seen["forward"].append((weight, weight_trained(weight)))
        y, data, scale, data_t = reference.forward(x, x_data, x_scale, weight, bias, recipe)
        if x_data is None and weight_trained(weight):  # the transposed bytes the GPU GEMMs write
            data_t = data.reshape(-1, data.shape[-1]).t().contiguous()
        return y, data, scale, data_t

    def backward(dy, x_data, x_scale, x_data_t, weight, *rest):
        seen["backward"].append(weight)
        return reference.backward(dy, x_data, x_scale, x_data_t, weight, *rest)

    TABLE.add("fp8_linear", Implementation("recording", always, forward, backward))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.GELU(), nn.Linear(64, 32, bias=False))
        compiled = opfuse.optimize(model, fp8=fp8.TensorScaling(), options=EAGER)
        for _ in range(2):
            compiled(torch.randn(4, 32)).sum().backward()
        with torch.no_grad():
            compiled(torch.randn(4, 32))
    finally:
        TABLE.remove("fp8_linear", "recording")
    weights = {id(p) for p in model.parameters()}
    training, inference = seen["forward"][:4], seen["forward"][4:]
    assert len(training) == 4 and len(seen["backward"]) == 4, seen
    assert all(id(w) in weights and trained for w, trained in training), training
    assert all(id(w) in weights for w in seen["backward"])
    # inference: the same parameters, not trained (no transposed bytes; W alone is quantized)
    assert inference and all(id(w) in weights and not trained for w, trained in inference), inference


@pytest.mark.parametrize("inductor", [False, True], ids=["eager-graph", "inductor"])
def test_fp8_linears_written_as_aten_ops_match_the_recipe(world1, monkeypatch, inductor):
    """Where the chosen fp8_linear implementation is built on torch._scaled_mm, the compile front
    end writes the quantization and the GEMMs as aten ops (opfuse/torch_compile/fp8_aten.py), for
    Inductor to fuse, instead of custom ops running the implementation's Python. On CPU the
    reference stands in for that implementation; the result must still be the recipe's."""
    from opfuse.torch_compile import fp8_aten

    monkeypatch.setattr(fp8_aten, "IMPLEMENTATIONS", {"reference"})
    x = torch.randn(2, 8, 32)  # 16 tokens: the FP8 weight gradient's multiple of 16
    for recipe in (fp8.TensorScaling(), fp8.TensorScaling(fp8_wgrad=False)):
        (y, grads), (want, want_grads), programs = run_both(Block, recipe, x, options={} if inductor else EAGER,
                                                            merge_projections=False)
        for got, ref in zip([y, *grads], [want, *want_grads]):
            assert relative(got, ref) < 1e-5, recipe
        assert rules(programs, "forward").count("fp8_linear") == 8


def test_fp8_aten_path_leaves_the_custom_ops_out_of_the_graph(world1, monkeypatch, tmp_path):
    from opfuse.torch_compile import fp8_aten

    monkeypatch.setattr(fp8_aten, "IMPLEMENTATIONS", {"reference"})
    with opfuse.config.override(dump_dir=str(tmp_path)):
        run_both(Block, fp8.TensorScaling(), torch.randn(2, 8, 32), merge_projections=False)
    (folder,) = os.listdir(tmp_path)
    after = (tmp_path / folder / "aten_after.py").read_text()
    assert "opfuse.compiled_fp8_gemm" not in after and "opfuse.fp8_linear_backward" not in after
    assert after.count("aten._scaled_mm") == 8 * 3  # forward, dgrad and wgrad of each linear
    # One amax per weight per step (the forward writes W.T's bytes for the data gradient too), one
    # per input the GEMMs quantize themselves (o, down: the others come quantized from a norm) and
    # one per output gradient.
    assert after.count("aten.amax") == 8 + 2 + 8
    # 5 tokens cannot take the FP8 weight gradient's GEMM: the custom ops (which pad) stay.
    monkeypatch.setattr(fp8_aten, "IMPLEMENTATIONS", {"reference"})
    assert fp8_aten.applies("reference", fp8.TensorScaling(), (2, 5, 32), True) is not None
    assert fp8_aten.applies("reference", fp8.TensorScaling(), (2, 5, 32), False) is None
    assert fp8_aten.applies("reference", fp8.RowwiseScaling(), (16, 32), True) is not None
    assert fp8_aten.applies("cuda_something", fp8.TensorScaling(), (16, 32), True) is not None


def test_fp8_aten_path_with_biases_and_inputs_without_grad(world1, monkeypatch):
    """Biases go into torch._scaled_mm's epilogue (their gradient stays autograd's sum); a first
    layer whose input needs no gradient gets no data-gradient GEMM."""
    from opfuse.torch_compile import fp8_aten

    monkeypatch.setattr(fp8_aten, "IMPLEMENTATIONS", {"reference"})
    recipe = fp8.TensorScaling()

    def make():
        return nn.Sequential(Norm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    torch.manual_seed(0)
    model = make()
    torch.manual_seed(0)
    reference = emulated(make(), recipe)
    compiled = opfuse.optimize(model, fp8=recipe, options=EAGER)
    x = torch.randn(16, 32)
    y, want = compiled(x), reference(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    y.backward(g)
    want.backward(g)
    assert relative(y, want) < 1e-5
    for a, b in zip(model.parameters(), reference.parameters()):
        assert relative(a.grad, b.grad) < 1e-5


@pytest.mark.parametrize("inductor", [False, True], ids=["eager-graph", "inductor"])
def test_power_of_two_weight_scales_reach_compiled_graphs_through_the_one_read_quantizer(world1, monkeypatch, tmp_path,
                                                                                          inductor):
    """``TensorScaling(pow2_weight_scales=True)``: every weight of the aten path is quantized by
    ``opfuse::quantize_weight_pow2`` (no amax of a weight left to Inductor), outputs and gradients
    are the recipe's emulation (power-of-two weight scales), which differs from exact scales."""
    from opfuse.torch_compile import fp8_aten

    monkeypatch.setattr(fp8_aten, "IMPLEMENTATIONS", {"reference"})
    recipe = fp8.TensorScaling(pow2_weight_scales=True)
    x = torch.randn(2, 8, 32)
    with opfuse.config.override(dump_dir=str(tmp_path)):
        (y, grads), (want, want_grads), programs = run_both(Block, recipe, x, options={} if inductor else EAGER,
                                                            merge_projections=False)
    for got, ref in zip([y, *grads], [want, *want_grads]):
        assert relative(got, ref) < 1e-5
    torch.manual_seed(0)
    exact = emulated(Block(), fp8.TensorScaling())(x)
    assert relative(want, exact) > 1e-4  # the power-of-two scales are not a no-op
    (folder,) = os.listdir(tmp_path)
    after = (tmp_path / folder / "aten_after.py").read_text()
    # q, k, v, o (one shape) and gate, up (another) cast in one launch each; down and the head alone
    assert after.count("opfuse.quantize_weight_pow2.direct(") == 2
    assert re.findall(r"opfuse\.quantize_weights_pow2\.direct\(\[([^\]]*)\]", after) and sorted(
        len(w.split(",")) for w in re.findall(r"opfuse\.quantize_weights_pow2\.direct\(\[([^\]]*)\]", after)) == [2, 4]
    # o's and down's inputs, and the output gradients; compiled by Inductor (no CUDA graphs) the
    # three norms' quantizations too (written as aten ops: opfuse.config.fp8_aten).
    assert after.count("aten.amax") == 2 + 8 + (3 if inductor else 0)
    assert after.count("opfuse.compiled_norm_quantize") == (0 if inductor else 3)
    assert "pow2 weight scales" in programs[0].explain()


def test_power_of_two_weight_scales_through_the_custom_op_path(world1):
    """Token counts the aten path refuses (5 here) keep the custom ops: the same recipe there."""
    recipe = fp8.TensorScaling(pow2_weight_scales=True)
    (y, grads), (want, want_grads), _ = run_both(Block, recipe, torch.randn(2, 5, 32), merge_projections=False)
    for got, ref in zip([y, *grads], [want, *want_grads]):
        assert relative(got, ref) < 1e-5


def test_every_one_read_quantizer_of_a_compiled_graph_has_its_hint_reserved_on_the_weights_device(
        world1, monkeypatch, tmp_path):
    """The op makes no hint itself (it may run inside a CUDA-graph pool): each key in the graph was
    reserved when the graph was built, for the device of its weight."""
    import re

    from opfuse.families.quantize import weight_pow2
    from opfuse.torch_compile import fp8_aten

    monkeypatch.setattr(fp8_aten, "IMPLEMENTATIONS", {"reference"})
    reserved = []
    monkeypatch.setattr(weight_pow2, "reserve_hint",
                        lambda key, device, size=1: reserved.append((key, torch.device(device), size)))
    with opfuse.config.override(dump_dir=str(tmp_path)):
        run_both(Block, fp8.TensorScaling(pow2_weight_scales=True), torch.randn(2, 8, 32), merge_projections=False)
    (folder,) = os.listdir(tmp_path)
    after = (tmp_path / folder / "aten_after.py").read_text()
    calls = [(int(k), 1) for k in re.findall(r"opfuse\.quantize_weight_pow2\.direct\(\w+, (\d+),", after)]
    calls += [(int(k), len(w.split(","))) for w, k in
              re.findall(r"opfuse\.quantize_weights_pow2\.direct\(\[([^\]]*)\], (\d+),", after)]
    assert sum(size for _, size in calls) == 8 and len({k for k, _ in calls}) == len(calls), after
    assert set(calls) <= {(key, size) for key, _, size in reserved}, (calls, reserved)
    assert all(d == torch.device("cpu") for _, d, _ in reserved), reserved


def test_the_host_note_is_only_for_fp8_graphs_compiled_without_cuda_graphs():
    import types

    from opfuse.torch_compile.backend import _fp8_without_graphs

    for recipe, graphs, noted in ((fp8.TensorScaling(), False, True), (fp8.TensorScaling(), True, False),
                                  (None, False, False)):
        settings = types.SimpleNamespace(fp8=recipe, notes=[])
        _fp8_without_graphs(settings, graphs=graphs)
        assert bool(settings.notes) is noted, (recipe, graphs, settings.notes)


class LayerNormBlock(nn.Module):
    """A biased LayerNorm + residual before q/k/v, a bias before the add (the add + LayerNorm +
    quantize producer with every optional input)."""

    def __init__(self, hidden=32):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        with torch.no_grad():
            self.norm.weight.add_(0.1 * torch.randn(hidden))
            self.norm.bias.add_(0.1 * torch.randn(hidden))
        self.q, self.k = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x):
        h = x + self.o(x)
        f = self.norm(h)
        return h + torch.tanh(self.q(f)) * self.k(f)


PRODUCER_MODELS = {"llama-block": lambda: Block(), "layernorm": LayerNormBlock,
                   "gathered-quantize": lambda: GatheredThroughAView(None, True)}


@pytest.mark.parametrize("recipe", RECIPES, ids=["tensor", "row"])
@pytest.mark.parametrize("model", list(PRODUCER_MODELS))
@pytest.mark.parametrize("inductor", [False, True], ids=["eager-graph", "inductor"])
def test_fp8_producers_written_as_aten_ops_match_the_recipe_and_the_kernels_form(world1, recipe, model, inductor,
                                                                                 tmp_path):
    """``opfuse.config.fp8_aten``: the norm + quantize (RMSNorm, LayerNorm with a bias) and the
    standalone quantize written as aten ops give the recipe's emulation, outputs and gradients,
    as the custom-op form does; the dumped graph holds no producer custom op, and explain() lists
    each producer written that way."""
    make = PRODUCER_MODELS[model]
    if model == "gathered-quantize":
        make = lambda: GatheredThroughAView(world1, True)  # noqa: E731
    x = torch.randn(2, 8, 32) if model != "gathered-quantize" else torch.randn(1, 8, 32)
    options = {} if inductor else EAGER
    results = {}
    for mode in ("always", "never"):
        dump = tmp_path / mode
        with opfuse.config.override(fp8_aten=mode, dump_dir=str(dump)):
            (y, grads), (want, want_grads), programs = run_both(make, recipe, x, options=options,
                                                                merge_projections=False)
        for got, ref in zip([y, *grads], [want, *want_grads]):
            assert relative(got, ref) < 1e-5, (mode, recipe)
        results[mode] = [y, *grads]
        after = "".join((dump / folder / "aten_after.py").read_text() for folder in os.listdir(dump))
        producers = [f for f in rules(programs, "forward") if f in ("add_rmsnorm_quantize", "add_layernorm_quantize",
                                                                    "quantize")]
        assert producers, programs[0].explain()
        text = programs[0].explain()
        if mode == "always":
            assert "opfuse.compiled_norm_quantize" not in after and "opfuse.compiled_quantize" not in after
            assert f"{len(producers)} FP8 producer(s) written as aten ops" in text, text
        else:
            assert after.count("opfuse.compiled_norm_quantize") + after.count("opfuse.compiled_quantize") \
                == len(producers), after
            assert "written as aten ops" not in text
    for a, b in zip(results["always"], results["never"]):
        assert relative(a, b) < 1e-5


def test_fp8_aten_auto_follows_inductor_and_cuda_graphs():
    from opfuse.torch_compile.fp8_aten import producers_in_aten

    with opfuse.config.override(fp8_aten="auto"):
        assert producers_in_aten(inductor=True, cuda_graphs=False)
        assert not producers_in_aten(inductor=True, cuda_graphs=True)
        assert not producers_in_aten(inductor=False, cuda_graphs=False)
    for mode, want in (("always", True), ("never", False)):
        with opfuse.config.override(fp8_aten=mode):
            assert all(producers_in_aten(i, g) is want for i in (False, True) for g in (False, True))
    with pytest.raises(ValueError, match="fp8_aten.*'auto', 'always', 'never'"):
        opfuse.config.fp8_aten = "yes"


class BiasedSequenceParallel(SequenceParallel):
    """:class:`SequenceParallel` with a bias on the row GEMM, added once after the reduce-scatter
    (Megatron's row-parallel linear)."""

    def __init__(self, group, hidden=32, ffn=64):
        super().__init__(group, hidden, ffn)
        self.down_bias = nn.Parameter(0.1 * torch.randn(hidden))

    def forward(self, x):
        gathered = all_gather(self.norm(x), 0, self.group)
        summed = reduce_scatter(self.down(F.gelu(self.up(gathered))), "sum", 0, self.group)
        return x + (summed + self.down_bias)


@pytest.mark.parametrize("model", [SequenceParallel, BiasedSequenceParallel], ids=["no-bias", "bias"])
@pytest.mark.parametrize("recipe", [fp8.TensorScaling(), fp8.TensorScaling(pow2_weight_scales=True)],
                         ids=["tensor", "tensor-pow2"])
def test_fp8_collective_gemms_written_as_aten_ops(world1, monkeypatch, tmp_path, model, recipe):
    """``opfuse.config.fp8_aten``: the all-gather + FP8 GEMM as the FP8 bytes gathered by a
    functional collective then ``torch._scaled_mm``, and the FP8 GEMM + reduce-scatter as
    ``torch._scaled_mm`` then a functional reduce-scatter (the bias once after it), forward and
    backward the recipe's, as the custom ops' (the reference stands in for the GPU's scaled-GEMM
    implementation here)."""
    from opfuse.torch_compile import fp8_aten

    monkeypatch.setattr(fp8_aten, "IMPLEMENTATIONS", {"reference"})
    x = torch.randn(16, 32)  # 16 tokens: the FP8 weight gradient's multiple of 16
    results = {}
    for mode in ("always", "never"):
        dump = tmp_path / mode
        with opfuse.config.override(fp8_aten=mode, dump_dir=str(dump)):
            (y, grads), (want, want_grads), programs = run_both(lambda: model(world1), recipe, x)
        for got, ref in zip([y, *grads], [want, *want_grads]):
            assert relative(got, ref) < 1e-5, mode
        results[mode] = [y, *grads]
        after = "".join((dump / folder / "aten_after.py").read_text() for folder in os.listdir(dump))
        assert "linear_reduce_scatter_fp8" in rules(programs, "forward")
        text = programs[0].explain()
        if mode == "always":
            assert "opfuse.compiled_fp8_gemm" not in after and "_c10d_functional.reduce_scatter_tensor" in after
            assert "1 FP8 GEMM + reduce-scatter(s) written as aten ops" in text, text
            assert "1 all-gather + FP8 GEMM(s) written as aten ops" in text, text
        else:
            assert "opfuse.compiled_fp8_gemm" in after
            assert "written as aten ops" not in text
    for a, b in zip(results["always"], results["never"]):
        assert relative(a, b) < 1e-5
