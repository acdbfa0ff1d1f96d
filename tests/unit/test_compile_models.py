"""The torch.compile front end on the models people write (issue 29, items 2, 3 and 6), on one gloo
rank: both operand orders of a residual add, hand-written half-precision norms, graph breaks,
mixed residual dtypes, Hugging Face shapes (two all-reduced operands, a head-width projection, a
graph that ends with its block's all-reduce and add), variable sequence lengths; and what
``explain()`` says for every collective left apart (in the plain rule's terms, no FP8 rule when FP8
is not in use, no backward all-reduce measured against forward-only rules).

Graphs run through ``options={"inductor": False}`` except one dynamic-shape test compiled by
Inductor. The same shapes on 2 ranks: tests/dist/test_compile_hf.py.
"""

import copy

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import opfuse
from ..collectives_compat import all_gather, reduce_scatter
from ..megatron_tp import CopyToTP

EAGER = {"inductor": False}
H = 16


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def tolerance(dtype):
    """Per dtype; half-precision norms round twice in a model written with the weight after the cast
    back, once in the fused op."""
    return {torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2), torch.float16: dict(atol=4e-3, rtol=2e-3)}.get(
        dtype, dict(atol=1e-5, rtol=1e-5))


def rules_of(programs, phase=None):
    return sorted(f.rule for p in programs for f in (p.fusions_in(phase) if phase else p.fusions))


def near_miss_lines(program) -> list[str]:
    text = program.explain()
    body = text.split("near misses:", 1)[1].split("pass notes:", 1)[0]
    return [line.strip() for line in body.splitlines() if line.strip() and line.strip() != "none"]


def assert_no_fp8_rule(program):
    for line in near_miss_lines(program):
        assert "_quantize" not in line.split(" ")[0] and "_fp8" not in line.split(" ")[0], program.explain()


def randomized(module: nn.Module, seed: int = 0) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():  # vectors (norm weights, biases) near 1, matrices near 0
            noise = torch.randn(param.shape, generator=generator)
            param.copy_((1 + 0.1 * noise if param.dim() == 1 else 0.3 * noise).to(param.dtype))
    return module


def check_training(model, compiled, inputs, dtype=torch.float32):
    """Outputs and the gradients of every input and parameter equal eager."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    got = compiled(*leaves)
    got = got if isinstance(got, tuple) else (got,)
    params = [p for p in model.parameters() if p.requires_grad]
    grads_out = [torch.randn_like(g) for g in got]
    got_grads = torch.autograd.grad(got, leaves + params, grads_out, allow_unused=True)
    want = model(*leaves)
    want = want if isinstance(want, tuple) else (want,)
    want_grads = torch.autograd.grad(want, leaves + params, grads_out, allow_unused=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tolerance(dtype))
    for a, b in zip(got_grads, want_grads):
        if b is not None:
            torch.testing.assert_close(a, b, **tolerance(dtype))


class HFNorm(nn.Module):
    """Hugging Face Llama's RMSNorm: weight applied after the cast back."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(H, dtype=dtype))

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


class WeightFirstNorm(nn.Module):
    """A hand-written half-precision RMSNorm with the weight applied in float32, before the cast
    back: ``(normed * weight.float()).to(dtype)`` (what opfuse's reference computes)."""

    def __init__(self, dtype):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(H, dtype=dtype))

    def forward(self, x):
        dtype = x.dtype
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed * self.weight.float()).to(dtype)


# 29.2 (a): a bias added after the all-reduce, the residual added on either side ------------------------


class BiasAfterReduce(nn.Module):
    """``h = x + (all_reduce(o) + b)`` (``"h + y"``) or ``(all_reduce(o) + b) + x`` (``"y + h"``)."""

    def __init__(self, order, group, dtype=torch.float32):
        super().__init__()
        self.order, self.group = order, group
        self.bias = nn.Parameter(0.1 * torch.randn(H, dtype=dtype))
        self.norm = nn.RMSNorm(H, eps=1e-6, dtype=dtype)

    def forward(self, o, x):
        y = funcol.all_reduce(o, "sum", self.group) + self.bias
        h = x + y if self.order == "h + y" else y + x
        return self.norm(h), h


@pytest.mark.parametrize("order", ["h + y", "y + h"])
def test_bias_after_the_all_reduce_fuses_in_both_add_orders(world1, order):
    model = randomized(BiasAfterReduce(order, world1))
    compiled = opfuse.optimize(model, options=EAGER)
    check_training(model, compiled, [torch.randn(2, 3, H), torch.randn(2, 3, H)])
    (program,) = opfuse.programs(compiled)
    assert rules_of([program], "forward") == ["allreduce_add_rmsnorm"], program.explain()
    (record,) = program.fusions_in("forward")
    assert {"AllReduce", "Bias", "AddExtraInput", "RMSNorm"} <= set(record.ops)


# 29.2 (b): a graph break between the all-reduce and the add -------------------------------------------


class BreakAfterReduce(nn.Module):
    def __init__(self, how, group):
        super().__init__()
        self.how, self.group = how, group
        self.proj = nn.Linear(H, H, bias=False)
        self.norm = HFNorm()

    def forward(self, o, x):
        y = funcol.all_reduce(self.proj(o), "sum", self.group)
        if self.how == "print":
            print("between the all-reduce and the add")
        else:
            torch._dynamo.graph_break()
        h = x + y
        return self.norm(h), h


@pytest.mark.parametrize("how", ["print", "graph_break"])
def test_a_graph_break_after_the_all_reduce_is_explained_by_the_plain_rule(world1, how, capsys):
    model = randomized(BreakAfterReduce(how, world1))
    compiled = opfuse.optimize(model, options=EAGER)
    o, x = torch.randn(4, H), torch.randn(4, H)
    with torch.no_grad():
        for a, b in zip(compiled(o, x), model(o, x)):
            torch.testing.assert_close(a, b, **tolerance(torch.float32))
    first, second = opfuse.programs(compiled)
    assert rules_of([second]) == ["add_rmsnorm"]
    lines = [line for line in near_miss_lines(first) if "all_reduce" in line]
    assert len(lines) == 1, first.explain()
    assert lines[0].startswith("allreduce_add_rmsnorm ["), first.explain()
    assert "is an output of this graph" in lines[0] and "graph break" in lines[0], first.explain()
    assert_no_fp8_rule(first)


# 29.2 (c): half-precision hand-written norms, the weight cast in either place ----------------------------


@pytest.mark.parametrize("form", ["weight before the cast back", "weight after the cast back"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hand_written_half_norms_fuse_whichever_side_the_weight_is_on(world1, form, dtype):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = WeightFirstNorm(dtype) if form.startswith("weight before") else HFNorm(dtype)

        def forward(self, o, x):
            h = funcol.all_reduce(o, "sum", world1) + x
            return self.norm(h), h

    model = Block()
    compiled = opfuse.optimize(model, options=EAGER)
    check_training(model, compiled, [torch.randn(2, 3, H, dtype=dtype), torch.randn(2, 3, H, dtype=dtype)], dtype)
    (program,) = opfuse.programs(compiled)
    assert rules_of([program], "forward") == ["allreduce_add_rmsnorm"], program.explain()


# 29.2 (d) and explain()'s terms ----------------------------------------------------------------------------


def test_a_float32_residual_with_bf16_activations_is_explained_by_the_plain_rule(world1):
    norm = nn.RMSNorm(H, eps=1e-6)

    def forward(o, residual):
        h = funcol.all_reduce(o, "sum", world1).float() + residual
        return norm(h), h

    compiled = opfuse.optimize(forward, options=EAGER)
    with torch.no_grad():
        compiled(torch.randn(4, H, dtype=torch.bfloat16), torch.randn(4, H))
    (program,) = opfuse.programs(compiled)
    lines = [line for line in near_miss_lines(program) if "all_reduce" in line.split(":", 1)[1]]
    assert len(lines) == 1 and lines[0].startswith("allreduce_add_rmsnorm ["), program.explain()
    assert "casts it from bfloat16 to float32" in lines[0], program.explain()
    assert_no_fp8_rule(program)


def test_backward_all_reduces_are_not_listed_as_misses_of_forward_only_rules(world1):
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down, self.norm = nn.Linear(H, 2 * H, bias=False), nn.Linear(2 * H, H, bias=False), HFNorm()

        def forward(self, x):
            y = self.down(F.silu(self.up(CopyToTP.apply(x, world1))))
            h = x + funcol.all_reduce(y, "sum", world1)
            return self.norm(h)

    model = randomized(Layer())
    compiled = opfuse.optimize(model, options=EAGER)
    check_training(model, compiled, [torch.randn(4, H)])
    (program,) = opfuse.programs(compiled)
    assert rules_of([program], "forward") == ["allreduce_add_rmsnorm"]
    backward = [name for f in program.fusions_in("backward") for name in f.nodes if "all_reduce" in name]
    assert backward, program.explain()
    for line in near_miss_lines(program):
        assert not any(name in line for name in backward), program.explain()
    assert_no_fp8_rule(program)


def test_collectives_that_no_rule_takes_are_explained(world1):
    def forward(x):
        scattered = reduce_scatter(torch.relu(x), "sum", 0, world1)  # no GEMM before it
        gathered = all_gather(scattered, 0, world1)
        return torch.tanh(gathered)  # no GEMM after it

    compiled = opfuse.optimize(forward, options=EAGER)
    with torch.no_grad():
        torch.testing.assert_close(compiled(torch.randn(4, H)).shape, torch.Size([4, H]))
    (program,) = opfuse.programs(compiled)
    assert not program.fusions
    lines = near_miss_lines(program)
    scatter = [line for line in lines if "(ReduceScatter)" in line]
    gather = [line for line in lines if "(AllGather)" in line]
    assert len(scatter) == 1 and scatter[0].startswith("linear_reduce_scatter ["), program.explain()
    assert "expected BasicLinear before" in scatter[0] and "relu" in scatter[0], program.explain()
    assert len(gather) == 1 and gather[0].startswith("all_gather_linear ["), program.explain()
    assert "expected BasicLinear" in gather[0] and "tanh" in gather[0], program.explain()
    assert_no_fp8_rule(program)


# 29.6: Hugging Face shapes -----------------------------------------------------------------------------------


class VocabShardedStart(nn.Module):
    """The first layer of a model whose embedding is sharded by vocabulary (``tp_plan="auto"``):
    its output is all-reduced, normed, and added to the all-reduced attention output."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.embed = nn.Embedding(50, H)
        self.input_norm, self.post_norm = HFNorm(), HFNorm()
        self.o_proj = nn.Linear(H, H, bias=False)

    def forward(self, tokens):
        hidden = funcol.all_reduce(self.embed(tokens), "sum", self.group)
        residual = hidden
        attn = funcol.all_reduce(self.o_proj(self.input_norm(hidden)), "sum", self.group)
        hidden = residual + attn
        return self.post_norm(hidden), hidden


def test_two_all_reduced_operands_fuse_the_projections_all_reduce(world1):
    model = randomized(VocabShardedStart(world1))
    compiled = opfuse.optimize(model, options=EAGER)
    tokens = torch.randint(0, 50, (2, 5))
    with torch.no_grad():
        for a, b in zip(compiled(tokens), model(tokens)):
            torch.testing.assert_close(a, b, **tolerance(torch.float32))
    (program,) = opfuse.programs(compiled)
    # The embedding's all-reduce with the input norm, the projection's with the add and the norm.
    assert rules_of([program]) == ["allreduce_add_rmsnorm", "allreduce_add_rmsnorm"], program.explain()
    with_add = [f for f in program.fusions if "AddExtraInput" in f.ops]
    assert len(with_add) == 1, program.explain()


def test_an_add_that_takes_the_all_reduce_as_its_residual_says_why(world1):
    norm = HFNorm()

    def forward(a, o):
        first = funcol.all_reduce(a, "sum", world1)
        second = funcol.all_reduce(o, "sum", world1)
        h = first + second
        return norm(h), h, first * 2, second * 3  # neither reduced value stays inside a fusion

    compiled = opfuse.optimize(forward, options=EAGER)
    with torch.no_grad():
        compiled(torch.randn(4, H), torch.randn(4, H))
    (program,) = opfuse.programs(compiled)
    text = program.explain()
    assert "adds it as its residual (argument 1)" in text and "is also used by" in text, text


class HeadWidthAttention(nn.Module):
    """Qwen2 at one key/value head per rank: biased k/v projections of width head_dim, viewed as
    ``[B, S, 1, head_dim]``."""

    def __init__(self, head_dim=8):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(H, 2 * head_dim, bias=True)
        self.k_proj = nn.Linear(H, head_dim, bias=True)
        self.v_proj = nn.Linear(H, head_dim, bias=True)
        self.o_proj = nn.Linear(2 * head_dim, H, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k.expand_as(q), v.expand_as(q), is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def test_a_biased_projection_of_head_width_is_a_linear():
    model = randomized(HeadWidthAttention())
    compiled = opfuse.optimize(model, options=EAGER)
    check_training(model, compiled, [torch.randn(2, 5, H)])
    (program,) = opfuse.programs(compiled)
    gm = program.unfused_graph_module
    kinds = [gm.get_submodule(n.target).kind for n in gm.graph.nodes if n.op == "call_module"]
    assert kinds.count("BasicLinear") == 4 and kinds.count("Bias") == 3, kinds


class BlockGraph(nn.Module):
    """One decoder block as FSDP2 + TP compiles it (a graph per block): the graph ends with the
    MLP's all-reduce and the residual add, the next norm is in the next graph."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.norm = HFNorm()
        self.up, self.down = nn.Linear(H, 2 * H, bias=False), nn.Linear(2 * H, H, bias=False)

    def forward(self, x):
        return x + funcol.all_reduce(self.down(F.silu(self.up(self.norm(x)))), "sum", self.group)


def test_a_graph_ending_with_all_reduce_and_add_fuses_them(world1):
    model = randomized(BlockGraph(world1))
    compiled = opfuse.optimize(model, options=EAGER)
    check_training(model, compiled, [torch.randn(2, 3, H)])
    (program,) = opfuse.programs(compiled)
    (record,) = [f for f in program.fusions_in("forward") if "AllReduce" in f.ops]
    assert record.rule == "allreduce" and sorted(record.ops) == ["AddExtraInput", "AllReduce"], program.explain()
    assert_no_fp8_rule(program)


# 29.3: variable sequence lengths ---------------------------------------------------------------------------


class Layer(nn.Module):
    """A decoder layer's second half plus the next norm, biased (GPT-2 / Phi style)."""

    def __init__(self, group, norm="rms"):
        super().__init__()
        self.group = group
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)
        self.norm = nn.RMSNorm(H, eps=1e-6) if norm == "rms" else nn.LayerNorm(H)

    def forward(self, x):
        h = x + funcol.all_reduce(self.down(F.gelu(self.up(x))), "sum", self.group)
        return self.norm(h), h


def programs_so_far(compiled) -> int:
    """How many graphs the backend behind ``compiled`` has compiled (the ``"opfuse"`` name's backend
    is shared by every model compiled with it); 0 before the first (``programs`` raises then)."""
    try:
        return len(opfuse.programs(compiled))
    except RuntimeError as error:
        assert "nothing compiled yet" in str(error)
        return 0


def test_three_sequence_lengths_keep_their_fusions(world1):
    """The second length recompiles with a symbolic sequence dim (automatic dynamic shapes); the
    third reuses that graph. Every graph keeps its fusions, and opfuse adds no guard that would
    specialise the symbolic graph (a third compile)."""
    model = randomized(Layer(world1))
    compiled = torch.compile(model, backend="opfuse", options=EAGER)
    before = programs_so_far(compiled)
    for seq in (5, 7, 9):
        check_training(model, compiled, [torch.randn(2, seq, H)])
    programs = opfuse.programs(compiled)[before:]
    assert len(programs) == 2, programs
    for program in programs:
        assert "allreduce_add_rmsnorm" in rules_of([program], "forward"), program.explain()
    symbolic = programs[1].unfused_graph_module
    metas = [n.meta.get("opfuse_meta") for n in symbolic.graph.nodes if n.op == "call_module"]
    assert any(isinstance(m.shape[0], torch.SymInt) for m in metas if m is not None)
    assert not any("symbolic" in note for _, note in programs[1].notes)


def test_batch_and_sequence_both_symbolic(world1):
    model = randomized(Layer(world1, norm="layer"))
    compiled = opfuse.optimize(model, options=EAGER, dynamic=True)
    for shape in ((2, 5), (3, 4)):
        check_training(model, compiled, [torch.randn(*shape, H)])
    (program,) = opfuse.programs(compiled)
    assert "allreduce_add_layernorm" in rules_of([program], "forward"), program.explain()


class EpsilonAttributeNorm(nn.Module):
    """Hugging Face's RMSNorm: the epsilon a float attribute, added to the variance in Python."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(H))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


class ResidualThenNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.norm = nn.Linear(H, H), EpsilonAttributeNorm()

    def forward(self, x):
        h = x + self.proj(x)
        return self.norm(h), h


@pytest.mark.parametrize("how", ["optimize", "backend_name"])
def test_a_norm_epsilon_read_from_an_attribute_stays_a_constant_under_dynamic_true(how):
    """``dynamic=True`` makes Dynamo pass the floats it reads (``self.variance_epsilon``) as graph
    inputs; the norm's epsilon would then be a tensor no rule takes (every RMSNorm of a Hugging Face
    model was left unfused). opfuse has Dynamo specialise those epsilons: the add + norm fuses, and
    a changed epsilon recompiles (Dynamo guards its value) rather than running a stale one."""
    torch.manual_seed(0)
    model = ResidualThenNorm()
    if how == "optimize":
        compiled = opfuse.optimize(model, options=EAGER, dynamic=True)
    else:
        compiled = torch.compile(model, backend="opfuse", dynamic=True, options=EAGER)
    before = programs_so_far(compiled)
    for shape in ((2, 5), (3, 4)):
        check_training(model, compiled, [torch.randn(*shape, H)])
    programs = opfuse.programs(compiled)[before:]
    assert len(programs) == 1 and "add_rmsnorm" in rules_of(programs, "forward"), programs[0].explain()
    model.norm.variance_epsilon = 0.5
    check_training(model, compiled, [torch.randn(2, 6, H)])
    programs = opfuse.programs(compiled)[before:]
    assert len(programs) == 2 and "add_rmsnorm" in rules_of(programs[1:], "forward"), programs[1].explain()


def test_inductor_compiles_symbolic_token_counts(world1):
    model = randomized(Layer(world1))
    compiled = torch.compile(model, backend="opfuse")
    before = programs_so_far(compiled)
    with torch.no_grad():
        for seq in (3, 4, 6):
            x = torch.randn(2, seq, H)
            for a, b in zip(compiled(x), model(x)):
                torch.testing.assert_close(a, b, **tolerance(torch.float32))
    programs = opfuse.programs(compiled)[before:]
    assert len(programs) == 2 and all("allreduce_add_rmsnorm" in rules_of([p]) for p in programs), programs


def test_optimize_keeps_static_shapes_by_default(world1):
    model = randomized(Layer(world1))
    compiled = opfuse.optimize(model, options=EAGER)
    with torch.no_grad():
        for seq in (3, 4):
            compiled(torch.randn(1, seq, H))
    programs = opfuse.programs(compiled)
    assert len(programs) == 2
    for program in programs:
        metas = [n.meta.get("opfuse_meta") for n in program.unfused_graph_module.graph.nodes]
        assert all(isinstance(s, int) for m in metas if hasattr(m, "shape") for s in m.shape)


def test_implementations_whose_checks_need_the_token_count_are_skipped_with_the_reason():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from opfuse.machinery.implementation import CallSpec, Implementation, choose
    from opfuse.ops.base import TensorMeta

    env = ShapeEnv()
    tokens = env.create_unbacked_symint()
    spec = CallSpec("example", {"x": TensorMeta((2 * tokens, H), torch.float32, torch.device("cpu"))}, {})
    by_size = Implementation("by_size", lambda s: None if s.x.nbytes <= 1 << 20 else "too large", None)
    by_width = Implementation("by_width", lambda s: None if s.x.features == H else "other width", None)
    choice = choose(spec, [by_size, by_width])
    assert choice.name == "by_width"
    ((name, reason),) = choice.skipped
    assert name == "by_size" and "fixed size" in reason and "varies between calls" in reason
    assert not env.guards  # the question was refused, not answered with a guard


def test_lowering_writes_symbolic_sizes_as_graph_values():
    """A view back to ``[batch, seq, features]`` with both leading dims symbolic: the sizes come
    from graph values (a ``Sym`` input, else a ``sym_size`` of a tensor holding them), never as
    ``SymInt`` constants (which generated code cannot name)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from opfuse.torch_compile.lower import _Lowering

    gm = make_fx(lambda x: x.reshape(-1, H) * 2, tracing_mode="symbolic")(torch.randn(2, 3, H))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    flat = next(n for n in gm.graph.nodes if n.op == "call_function" and "mul" in str(n.target))
    lowering = _Lowering(None, gm)
    batch, seq, _ = x.meta["val"].shape
    sizes = lowering.size_args((batch, seq, H), flat)
    assert sizes[2] == H
    for dim, size in enumerate(sizes[:2]):
        assert isinstance(size, torch.fx.Node) and size.meta["val"].node.expr == x.meta["val"].shape[dim].node.expr
        assert size.target is torch.ops.aten.sym_size.int or size.op == "placeholder"
    (tokens, width) = lowering.size_args((batch * seq, H), flat)
    assert width == H and (tokens == -1 or isinstance(tokens, torch.fx.Node))


def test_view_checks_follow_real_tensors_where_fake_tensors_differ():
    """Whether a view can be taken after a fusion changed strides is decided as real tensors decide
    it (ATen's ``computeStride``), not by a fake tensor's ``view``, which accepts
    ``[2, 1, 4, 8]`` with strides ``(64, 32, 8, 1)`` (q sliced from a merged q/k/v GEMM at one token
    per sequence) as ``[8, 8]`` where real tensors refuse it (the HF test: batched generation)."""
    from opfuse.torch_compile.view_layouts import _view_strides

    generator = torch.Generator().manual_seed(0)
    cases = [((2, 1, 4, 8), (64, 32, 8, 1), (8, 8)), ((2, 1, 4, 8), (64, 64, 8, 1), (-1, 8)),
             ((2, 12, 4, 8), (768, 64, 8, 1), (96, 8)), ((2, 1, 32), (64, 32, 1), (2, 1, 4, 8)),
             ((1, 3, 4), (12, 4, 1), (12,)), ((3, 1, 4), (4, 99, 1), (12, 1)), ((4, 3), (1, 4), (12,))]
    for sizes, strides, shape in cases:
        real = torch.randn(4096, generator=generator).as_strided(sizes, strides)
        try:
            want = list(real.view(shape).stride())
        except RuntimeError:
            want = None
        target = list(real.reshape(shape).shape)
        got = _view_strides(list(sizes), list(strides), target)
        assert (got is None) == (want is None), (sizes, strides, shape, got, want)
        if want is not None:
            assert [g for g, n in zip(got, target) if n != 1] == [w for w, n in zip(want, target) if n != 1]


class ProjectionThenGELU(nn.Module):
    """A biased projection and a GELU, then q/k/v-style projections of one input; float32
    parameters."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(H, 32)
        self.q, self.k = nn.Linear(32, H, bias=False), nn.Linear(32, 8, bias=False)

    def forward(self, x):
        h = F.gelu(self.up(x))
        return torch.cat([self.q(h), self.k(h)], dim=-1).float().square().sum()


def test_linears_under_autocast_are_recognised():
    """``torch.autocast`` over float32 parameters casts each weight and bias in the graph (and each
    GEMM's input, once per GEMM): the casts are still the linear's weight and bias (GEMM + bias +
    GELU fuses), the repeated casts of one input are merged, and the loss and every float32
    gradient are eager autocast's. Projections whose float32 weights are cast apart are not merged
    (the join would copy them on every call), and explain() says so."""
    model = randomized(ProjectionThenGELU())
    compiled = opfuse.optimize(copy.deepcopy(model), options=EAGER)
    x = torch.randn(2, 5, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = model(x), compiled(x)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    for (name, param), mine in zip(model.named_parameters(), compiled._orig_mod.parameters()):
        assert mine.dtype == torch.float32 and mine.grad.dtype == torch.float32, name
        torch.testing.assert_close(mine.grad, param.grad, rtol=2e-2, atol=2e-2, msg=name)
    (program,) = opfuse.programs(compiled)
    assert "repeated dtype cast" in program.explain(), program.explain()
    # Training keeps the pre-activation for GELU's backward; inference fuses the GEMM + bias + GELU.
    inference = opfuse.optimize(copy.deepcopy(model), options=EAGER)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(inference(x), model(x), rtol=1e-2, atol=1e-2)
    (program,) = opfuse.programs(inference)
    assert "linear_bias_activation" in rules_of([program], "forward"), program.explain()
