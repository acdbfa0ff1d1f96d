"""The torch.compile front end on one rank: which forms of ordinary PyTorch code become which
opfuse ops, what fuses, what explain() says when something does not, gradients, dumps.

Graphs run through ``options={"inductor": False}`` (AOTAutograd + Inductor's decompositions and
partitioner, no code generation: seconds instead of a minute per graph on two CPU cores); one
test compiles with Inductor itself. The distributed example (2 gloo ranks, torch.distributed and
DTensor) is tests/dist/test_compile_backend.py.
"""

import os

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import opfuse
from ..collectives_compat import all_gather, reduce_scatter
from opfuse import ops

EAGER = {"inductor": False}
H = 16


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def tolerance(dtype):
    return dict(atol=2e-2, rtol=1.6e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)


class HFNorm(nn.Module):
    """Hugging Face Llama's RMSNorm (weight applied after the cast back)."""

    def __init__(self, dtype, weight_dtype=None):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(H, dtype=weight_dtype or dtype))

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


class GPTFastNorm(nn.Module):
    """gpt-fast's RMSNorm (x * x, type_as, weight on the right)."""

    def __init__(self, dtype):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(H, dtype=dtype))

    def forward(self, x):
        out = x.float()
        out = out * torch.rsqrt(torch.mean(out * out, dim=-1, keepdim=True) + 1e-5)
        return out.type_as(x) * self.weight


def make_norm(form, dtype):
    if form == "hf":
        return HFNorm(dtype)
    if form == "gpt-fast":
        return GPTFastNorm(dtype)
    if form == "nn.RMSNorm":
        norm = nn.RMSNorm(H, eps=1e-6, dtype=dtype)
    else:
        norm = nn.LayerNorm(H, dtype=dtype)
    with torch.no_grad():
        for param in norm.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return norm


class ReduceAddNorm(nn.Module):
    """``y = norm(all_reduce(x) + residual)``; returns ``(y, new residual)`` like a decoder layer."""

    def __init__(self, norm, group):
        super().__init__()
        self.norm = norm
        self.group = group

    def forward(self, x, residual):
        h = funcol.all_reduce(x, "sum", self.group) + residual
        return self.norm(h), h


def rules_of(programs, phase=None):
    return sorted(f.rule for p in programs for f in (p.fusions_in(phase) if phase else p.fusions))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["hf", "gpt-fast", "nn.RMSNorm", "nn.LayerNorm"])
def test_norm_forms_fuse_with_the_all_reduce_and_the_residual(world1, form, dtype):
    model = ReduceAddNorm(make_norm(form, dtype), world1)
    x, r = torch.randn(3, 5, H, dtype=dtype), torch.randn(3, 5, H, dtype=dtype)
    compiled = opfuse.optimize(model, options=EAGER)
    with torch.no_grad():
        want, got = model(x, r), compiled(x, r)
    rule = "allreduce_add_layernorm" if form == "nn.LayerNorm" else "allreduce_add_rmsnorm"
    assert rules_of(opfuse.programs(compiled)) == [rule]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tolerance(dtype))


def test_gradients_equal_eager_and_both_phases_are_listed(world1):
    torch.manual_seed(0)
    model = nn.Module()
    model.inner = ReduceAddNorm(HFNorm(torch.float32), world1)
    model.up = nn.Linear(H, 2 * H)
    model.down = nn.Linear(2 * H, H)

    def forward(x, residual):
        y, h = model.inner(model.down(F.gelu(model.up(x))), residual)
        return y * h

    x = torch.randn(6, H, requires_grad=True)
    r = torch.randn(6, H, requires_grad=True)
    grad = torch.randn(6, H)
    compiled = opfuse.optimize(forward, options=EAGER)
    got = compiled(x, r)
    got_grads = torch.autograd.grad(got, [x, r, *model.parameters()], grad)
    want = forward(x, r)
    want_grads = torch.autograd.grad(want, [x, r, *model.parameters()], grad)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    (program,) = opfuse.programs(compiled)
    assert program.kind == "training"
    assert "allreduce_add_rmsnorm" in rules_of([program], "forward")


def test_bias_and_gelu_after_a_linear_fuse(world1):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(approximate="tanh"))
    x = torch.randn(4, H)
    compiled = opfuse.optimize(model, options=EAGER)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    assert rules_of(opfuse.programs(compiled)) == ["linear_bias_activation"]


def test_all_gather_and_reduce_scatter_fuse_with_their_gemms(world1):
    torch.manual_seed(2)
    up, down = nn.Linear(H, 2 * H, bias=False), nn.Linear(2 * H, H, bias=False)

    def block(x):
        gathered = all_gather(x, 0, world1)
        return reduce_scatter(down(torch.relu(up(gathered))), "sum", 0, world1)

    x = torch.randn(8, H)
    compiled = opfuse.optimize(block, options=EAGER)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), block(x), atol=1e-5, rtol=1e-5)
    assert rules_of(opfuse.programs(compiled)) == ["all_gather_linear", "linear_reduce_scatter"]


# explain() ---------------------------------------------------------------------------------------------


def explained(model, *inputs):
    compiled = opfuse.optimize(model, options=EAGER)
    with torch.no_grad():
        compiled(*inputs)
    (program,) = opfuse.programs(compiled)
    return program, program.explain()


def test_explain_names_a_cast_between_the_all_reduce_and_the_add(world1):
    norm = HFNorm(torch.float32)

    def forward(x, residual):  # residual stream in float32, all-reduce in bfloat16
        h = funcol.all_reduce(x, "sum", world1).float() + residual
        return norm(h), h

    program, text = explained(forward, torch.randn(4, H, dtype=torch.bfloat16), torch.randn(4, H))
    assert "allreduce_add_rmsnorm" not in rules_of([program])
    assert "found convert_element_type" in text and "AddExtraInput" in text, text


def test_explain_names_a_reduced_value_used_elsewhere(world1):
    norm = HFNorm(torch.float32)

    def forward(x, residual):
        reduced = funcol.all_reduce(x, "sum", world1)
        h = reduced + residual
        return norm(h), h, reduced * 2

    program, text = explained(forward, torch.randn(4, H), torch.randn(4, H))
    assert "allreduce_add_rmsnorm" not in rules_of([program])
    assert "is also used by" in text, text


def test_explain_names_a_norm_weight_of_another_dtype(world1):
    norm = HFNorm(torch.bfloat16, weight_dtype=torch.float32)
    model = ReduceAddNorm(norm, world1)
    program, text = explained(model, torch.randn(4, H, dtype=torch.bfloat16), torch.randn(4, H, dtype=torch.bfloat16))
    assert rules_of([program]) == ["allreduce"]
    assert "weight is float32, input is bfloat16" in text, text


# Composition, dumps, API -------------------------------------------------------------------------------


def test_a_model_with_sequential_blocks_compiles(world1):
    torch.manual_seed(3)
    block = ops.Sequential(ops.Linear(H, H, parallel="row"), ops.AddExtraInput(), ops.MakeExtraOutput(),
                           ops.RMSNorm(H))
    pre = nn.Linear(H, H)

    def forward(x):
        y, h = block(torch.relu(pre(x)), x)
        return y + h

    x = torch.randn(4, H, requires_grad=True)
    want = forward(x)
    compiled = opfuse.optimize(forward, options=EAGER)
    got = compiled(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, [x, *block.parameters()], grad),
                    torch.autograd.grad(want, [x, *block.parameters()], grad)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_dump_writes_the_op_graph_after_each_pass_and_the_aten_graphs(world1, tmp_path):
    model = ReduceAddNorm(HFNorm(torch.float32), world1)
    with opfuse.config.override(dump_dir=str(tmp_path)):
        compiled = opfuse.optimize(model, options=EAGER)
        with torch.no_grad():
            compiled(torch.randn(2, H), torch.randn(2, H))
    (folder,) = os.listdir(tmp_path)
    files = set(os.listdir(tmp_path / folder))
    assert {"aten_before.py", "aten_after.py", "00_lowered.py", "explain.txt"} <= files
    after = (tmp_path / folder / "aten_after.py").read_text()
    assert "opfuse.allreduce_add_rmsnorm" in after and "_c10d_functional.all_reduce" not in after
    (program,) = opfuse.programs(compiled)
    for fmt in ("python", "text", "dot", "html"):
        assert "allreduce_add_rmsnorm" in program.dump(fmt, graph="both")


def test_programs_of_the_backend_name_and_of_other_compiles(world1):
    model = ReduceAddNorm(HFNorm(torch.float32), world1)
    compiled = torch.compile(model, backend="opfuse", options=EAGER)
    with torch.no_grad():
        compiled(torch.randn(2, H), torch.randn(2, H))
    assert rules_of(opfuse.programs(compiled)[-1:]) == ["allreduce_add_rmsnorm"]
    assert opfuse.programs(compiled)[-1] in opfuse.programs()
    assert "opfuse" in torch._dynamo.list_backends()
    with pytest.raises(ValueError, match="not compiled by opfuse"):
        opfuse.programs(torch.compile(model, backend="eager"))
    with pytest.raises(TypeError, match="backend"):
        opfuse.optimize(model, backend="inductor")


def test_programs_of_module_compile_and_of_a_compiled_function(world1):
    """``model.compile(backend=...)`` leaves the compiled call on the module itself
    (``_compiled_call_impl``) and a compiled function keeps Dynamo's context in its closure:
    ``programs`` finds the backend behind both (it said "not compiled by opfuse")."""
    backend = opfuse.torch_compile.OpfuseBackend()
    model = ReduceAddNorm(HFNorm(torch.float32), world1)
    model.compile(backend=backend, options=EAGER)
    with torch.no_grad():
        model(torch.randn(2, H), torch.randn(2, H))
    assert opfuse.programs(model) == backend.programs
    assert rules_of(backend.programs) == ["allreduce_add_rmsnorm"]
    other = opfuse.torch_compile.OpfuseBackend()
    function = torch.compile(lambda x, residual: model.norm(x + residual), backend=other, options=EAGER)
    with torch.no_grad():
        function(torch.randn(2, H), torch.randn(2, H))
    assert opfuse.programs(function) == other.programs and rules_of(other.programs) == ["add_rmsnorm"]


def test_inductor_compiles_the_fused_graph(world1):
    torch.manual_seed(4)
    model = ReduceAddNorm(HFNorm(torch.bfloat16), world1)
    x, r = torch.randn(4, H, dtype=torch.bfloat16), torch.randn(4, H, dtype=torch.bfloat16)
    compiled = opfuse.optimize(model)
    with torch.no_grad():
        got, want = compiled(x, r), model(x, r)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tolerance(torch.bfloat16))
    assert rules_of(opfuse.programs(compiled)) == ["allreduce_add_rmsnorm"]


def test_registered_passes_run_on_compiled_graphs(world1):
    from opfuse.passes import register_pass, remove_pass

    @register_pass(name="count_norms", after="partition")
    def count_norms(gm, ctx):
        ctx.note(f"{sum(ctx.kind(n) == 'RMSNorm' for n in gm.graph.nodes)} norms")

    try:
        model = ReduceAddNorm(HFNorm(torch.float32), world1)
        compiled = opfuse.optimize(model, options=EAGER)
        with torch.no_grad():
            compiled(torch.randn(2, H), torch.randn(2, H))
    finally:
        remove_pass("count_norms")
    (program,) = opfuse.programs(compiled)
    assert ("count_norms", "1 norms") in program.notes
    assert "count_norms: 1 norms" in program.explain()


class BiasedMLP(nn.Module):
    """GPT-2 / Phi style: biased projections, GELU, residual add, then a norm."""

    def __init__(self, norm):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(H, 2 * H), nn.Linear(2 * H, H), norm

    def forward(self, x):
        return self.norm(self.down(F.gelu(self.up(x))) + x)


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_inductor_compiles_biased_projections(norm, train):
    """Issue 29.1: the bias that add_*norm takes leaves its addmm's GEMM behind; the re-emitted GEMM
    must be in Inductor's decomposed form (it refused ``aten.t`` before)."""
    torch.manual_seed(7)
    model = BiasedMLP(nn.RMSNorm(H) if norm == "rms" else nn.LayerNorm(H))
    x = torch.randn(4, 3, H, requires_grad=train)
    compiled = opfuse.optimize(model)
    with torch.set_grad_enabled(train):
        got, want = compiled(x), model(x)
    torch.testing.assert_close(got, want, **tolerance(torch.float32))
    if train:
        (gx,) = torch.autograd.grad(got.sum(), x)
        (wx,) = torch.autograd.grad(want.sum(), x)
        torch.testing.assert_close(gx, wx, **tolerance(torch.float32))
    assert f"add_{norm}norm" in rules_of(opfuse.programs(compiled))


def test_compiled_graphs_call_the_fused_ops_through_their_direct_overloads(world1, tmp_path):
    """After the graph pass every fused op is called through ``opfuse::<name>.direct`` (same schema,
    fake and function, without the custom op's autograd and wrapper layers: the backward is already
    in the graph), in training graphs too, and the results stay eager's."""
    import re

    from opfuse.machinery.fused_op import DIRECT_OVERLOADS

    for default, direct in DIRECT_OVERLOADS.items():
        assert [(a.name, str(a.type)) for a in direct._schema.arguments] == \
            [(a.name, str(a.type)) for a in default._schema.arguments], default
        assert [str(r.type) for r in direct._schema.returns] == [str(r.type) for r in default._schema.returns]
    torch.manual_seed(0)
    model = ReduceAddNorm(HFNorm(torch.float32), world1)
    x, r = torch.randn(6, H, requires_grad=True), torch.randn(6, H, requires_grad=True)
    grad = torch.randn(6, H)
    with opfuse.config.override(dump_dir=str(tmp_path)):
        compiled = opfuse.optimize(model, options=EAGER)
        got = compiled(x, r)[0]
    got_grads = torch.autograd.grad(got, [x, r, *model.parameters()], grad)
    want = model(x, r)[0]
    want_grads = torch.autograd.grad(want, [x, r, *model.parameters()], grad)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    (folder,) = os.listdir(tmp_path)
    after = (tmp_path / folder / "aten_after.py").read_text()
    calls = re.findall(r"torch\.ops\.opfuse\.(\w+)\.(\w+)\(", after)
    assert ("allreduce_add_rmsnorm", "direct") in calls, after
    assert all(overload == "direct" for _, overload in calls), calls


def test_a_direct_overload_computes_what_its_custom_op_computes():
    from opfuse.families.residual_norm import op as residual_norm

    x, r, w = torch.randn(5, H), torch.randn(5, H), torch.randn(H)
    args = (x, None, r, w, None, 1e-6, "", True, "reference")
    for a, b in zip(torch.ops.opfuse.add_rmsnorm.default(*args), torch.ops.opfuse.add_rmsnorm.direct(*args)):
        assert torch.equal(a, b)
    y, h = torch.ops.opfuse.add_rmsnorm.direct(x, None, r, w, None, 1e-6, "", True, "reference")
    assert y is not x and h is not r and residual_norm.AddRMSNorm.custom_op.direct is torch.ops.opfuse.add_rmsnorm.direct


@pytest.mark.parametrize("inductor", [False, True], ids=["aot_eager", "inductor"])
def test_graphs_without_tensors_compile(inductor):
    """Dynamo hands the backend graphs that compute no tensor at all: an empty one (a frame of
    JetMoE's forward under automatic dynamic shapes), or one computing only sizes. Nothing to
    fuse, nothing to fail on (the lowering looked for the graph's fake tensors even then)."""
    from opfuse.torch_compile.backend import OpfuseBackend

    gm = torch.fx.GraphModule(nn.Module(), torch.fx.Graph())
    gm.graph.output(())
    gm.recompile()
    backend = OpfuseBackend()
    assert list(backend(gm, [], options={"inductor": inductor})()) == []
    (program,) = backend.programs
    assert program.fusions == [] and "fusions: none" in program.explain()
    if not inductor:  # Inductor's C++ code generation: minutes on a CI host, the empty graph covers it
        torch._dynamo.reset()
        sizes = opfuse.optimize(lambda x, n: x.size(0) * n + 1, dynamic=True, options={"inductor": False})
        assert sizes(torch.randn(3), 4) == 13 and sizes(torch.randn(5), 6) == 31
        torch._dynamo.reset()
