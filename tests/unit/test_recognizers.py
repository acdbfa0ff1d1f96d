"""Recognition is open: families and users register recognizers, and a rule over an op with a
recognizer fires on torch.compile graphs (one CPU process, ``options={"inductor": False}``), with
outputs and gradients equal to eager."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opfuse
from opfuse.machinery.recognizer import Phase, Recognizer, RecognizerError, RecognizerRegistry
from opfuse.ops.activation import ACTIVATIONS
from opfuse.passes import OpSpec, Pattern, Replacement, register_rule, remove_rule
from opfuse.torch_compile import disabled_recognizers, recognizers

# User-side fused ops: torch.library custom ops with fakes, as a fused module must call (the
# joint graph's backward nodes stay, so these need no autograd).


@torch.library.custom_op("opfuse_test::gated", mutates_args=())
def _gated(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    return ACTIVATIONS[activation](gate) * up


@_gated.register_fake
def _(gate, up, activation):
    return torch.empty_like(gate)


@torch.library.custom_op("opfuse_test::grouped", mutates_args=())
def _grouped(x: torch.Tensor, sizes: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    offs = torch.cumsum(sizes, 0, dtype=torch.int32)
    return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)


@_grouped.register_fake
def _(x, sizes, weight):
    return x.new_empty(x.shape[0], weight.shape[1])


class CallsCustomOp(nn.Module):
    """A user's fused module: ``op(*inputs, [weight], *constants)`` (lowering binds the matched op's
    stand-in weight to the graph input it stands for)."""

    def __init__(self, op, *constants, weight=None):
        super().__init__()
        self.op, self.constants, self.weight = op, constants, weight

    def forward(self, *inputs):
        return self.op(*inputs, *(() if self.weight is None else (self.weight,)), *self.constants)


@pytest.fixture
def user_rules():
    made = [
        register_rule(name="test_user_gated", priority=50, pattern=Pattern.chain(OpSpec("act", "GatedActivation")),
                      build=lambda m: Replacement(CallsCustomOp(torch.ops.opfuse_test.gated, m["act"].op.activation),
                                                  [m.input("act", 0), m.input("act", 1)])),
        register_rule(name="test_user_grouped", priority=50, pattern=Pattern.chain(OpSpec("gemm", "BasicGroupedLinear")),
                      build=lambda m: Replacement(CallsCustomOp(torch.ops.opfuse_test.grouped, weight=m["gemm"].op.weight),
                                                  [m.input("gemm", 0), m.input("gemm", 1)])),
    ]
    yield made
    for rule in made:
        remove_rule(rule.name)


class GatedMLP(nn.Module):
    def __init__(self, activation, dtype=torch.float32, gate_bias=False):
        super().__init__()
        self.gate = nn.Linear(16, 32, bias=gate_bias, dtype=dtype)
        self.up = nn.Linear(16, 32, bias=False, dtype=dtype)
        self.down = nn.Linear(32, 16, bias=False, dtype=dtype)
        self.act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation]

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 16, 8, dtype=torch.bfloat16) / 4)

    def forward(self, x, counts):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x, self.weight.transpose(-2, -1), offs=offs)


def _run(model, *inputs):
    """Output and the gradients of the float inputs and the parameters, for ``(y * y).sum()``."""
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    model.zero_grad()
    y = model(*inputs)
    (y.float() * y.float()).sum().backward()
    return y.detach(), [t.grad for t in inputs if t.is_floating_point()] + [p.grad.clone() for p in model.parameters()]


def _compiled_rules(compiled):
    return [f.rule for program in opfuse.programs(compiled) for f in program.fusions]


@pytest.mark.parametrize("activation,dtype", [("silu", torch.float32), ("gelu", torch.float32),
                                              ("gelu_tanh", torch.bfloat16), ("silu", torch.bfloat16)])
def test_user_rule_over_gated_activation_fires_under_torch_compile(user_rules, activation, dtype):
    torch.manual_seed(0)
    model = GatedMLP(activation, dtype)
    x = torch.randn(2, 3, 16, dtype=dtype)
    y_eager, grads_eager = _run(model, x)
    compiled = opfuse.optimize(model, options={"inductor": False})
    y, grads = _run(compiled, x)
    assert "test_user_gated" in _compiled_rules(compiled)
    torch.testing.assert_close(y, y_eager)
    for got, want in zip(grads, grads_eager):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("user", [True, False], ids=["user_rule", "builtin_rule"])
def test_rules_over_grouped_linear_fire_under_torch_compile(request, user):
    """A user's rule over BasicGroupedLinear (bit-equal to eager: its op calls torch._grouped_mm) and,
    without it, the built-in grouped_linear (its reference on CPU: a loop of F.linear)."""
    if user:
        request.getfixturevalue("user_rules")
    torch.manual_seed(0)
    model = Experts()
    x, counts = torch.randn(24, 8, dtype=torch.bfloat16), torch.tensor([6, 2, 9, 7])
    y_eager, grads_eager = _run(model, x, counts)
    compiled = opfuse.optimize(model, options={"inductor": False})
    y, grads = _run(compiled, x, counts)
    fusions = [(f.rule, f.impl) for program in opfuse.programs(compiled) for f in program.fusions]
    assert fusions == ([("test_user_grouped", None)] if user else [("grouped_linear", "reference")])
    exact = {"rtol": 0, "atol": 0} if user else {}
    torch.testing.assert_close(y, y_eager, **exact)
    for got, want in zip(grads, grads_eager):
        torch.testing.assert_close(got, want)


class TitanExperts(nn.Module):
    """torchtitan's grouped experts: the group offsets computed once, read by all three grouped
    GEMMs (gate, up, down); ``counts`` from ``histc`` of float expert ids (Hugging Face 5 on CPU)
    or integer counts."""

    def __init__(self, experts=4, hidden=8, ffn=16, histogram=False):
        super().__init__()
        self.histogram = histogram
        self.w1 = nn.Parameter(torch.randn(experts, ffn, hidden, dtype=torch.bfloat16) / 4)
        self.w3 = nn.Parameter(torch.randn(experts, ffn, hidden, dtype=torch.bfloat16) / 4)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, ffn, dtype=torch.bfloat16) / 4)

    def forward(self, x, counts):
        if self.histogram:  # counts holds each row's expert id here
            counts = torch.histc(counts.float(), bins=self.w1.shape[0], min=0, max=self.w1.shape[0] - 1)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs)) * \
            torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)


@pytest.mark.parametrize("histogram", [False, True], ids=["integer-counts", "histc-counts"])
def test_every_grouped_gemm_reading_shared_offsets_is_recognised(histogram):
    """The three grouped GEMMs of an MoE block read one ``cumsum``: the first region claimed it, so
    the others overlapped and were dropped (only one of three fused); Hugging Face 5 on CPU counts
    tokens per expert with ``histc`` of float ids, float counts the op refused without a word."""
    torch.manual_seed(0)
    model = TitanExperts(histogram=histogram)
    x = torch.randn(24, 8, dtype=torch.bfloat16)
    counts = torch.tensor([6, 2, 9, 7])
    if histogram:
        counts = torch.repeat_interleave(torch.arange(4), counts)
    y_eager, grads_eager = _run(model, x, counts)
    compiled = opfuse.optimize(model, options={"inductor": False})
    y, grads = _run(compiled, x, counts)
    fusions = [f.rule for program in opfuse.programs(compiled) for f in program.fusions]
    assert fusions.count("grouped_linear") == 3, [p.explain() for p in opfuse.programs(compiled)]
    torch.testing.assert_close(y, y_eager)
    for got, want in zip(grads, grads_eager):
        torch.testing.assert_close(got, want)


def test_a_biased_gelu_gate_keeps_the_gemm_bias_gelu_fusion():
    """GELU(x @ Wg.T + bg) * up: the gated recognizer leaves the GELU to linear_bias_activation
    (which fuses in inference graphs, where nothing else reads the pre-activation)."""
    torch.manual_seed(0)
    model = GatedMLP("gelu", gate_bias=True)
    x = torch.randn(4, 16)
    compiled = opfuse.optimize(model, options={"inductor": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert _compiled_rules(compiled) == ["linear_bias_activation"]


def test_disabled_recognizers_leave_the_aten_nodes(user_rules):
    model = GatedMLP("silu")
    x = torch.randn(4, 16)
    with disabled_recognizers("gated_activation"):
        compiled = opfuse.optimize(model, options={"inductor": False})
        _run(compiled, x)
    assert "test_user_gated" not in _compiled_rules(compiled)


def test_recognizers_run_by_phase_then_registration_order():
    order = [(r.phase, r.name) for r in recognizers()]
    assert order == sorted(order, key=lambda item: item[0])
    names = [name for _, name in order]
    # Today's behaviour: norms and activations, then collectives, then GEMMs, then adds; a gated
    # activation is claimed before the activation it contains.
    assert names.index("gated_activation") < names.index("gelu") < names.index("collective") \
        < names.index("linear") < names.index("add")
    assert names.index("rms_norm") < names.index("layer_norm") < names.index("gelu")


def test_recognizer_registry_errors_name_the_recognizer():
    registry = RecognizerRegistry()
    registry.add(Recognizer("mine", Phase.ADDS, lambda node, found: None))
    with pytest.raises(RecognizerError, match="a recognizer named 'mine' exists"):
        registry.add(Recognizer("mine", Phase.ADDS, lambda node, found: None))
    with pytest.raises(RecognizerError, match=r"no recognizer named 'mien' \(did you mean 'mine'\?\)"):
        registry.remove("mien")
    with pytest.raises(RecognizerError, match=r"fn must take \(node, found\)"):
        Recognizer("bad", Phase.ADDS, lambda node: None)
    with pytest.raises(RecognizerError, match="phase='late'"):
        Recognizer("bad", "late", lambda node, found: None)


def test_an_op_that_refuses_what_was_recognised_says_so_in_explain():
    """A region whose op refuses its inputs stays unfused; explain() names it and the reason (a
    grouped GEMM over float group sizes that are not a histogram's counts)."""
    model = Experts()
    compiled = opfuse.optimize(model, options={"inductor": False})
    x, counts = torch.randn(24, 8, dtype=torch.bfloat16), torch.tensor([6.0, 2.0, 9.0, 7.0])
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, counts), model(x, counts))
    (program,) = opfuse.programs(compiled)
    assert not program.fusions
    assert "recognised as BasicGroupedLinear, left unfused" in program.explain()
    assert "group_sizes has dtype float32, expected int32 or int64" in program.explain()
