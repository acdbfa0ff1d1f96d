"""Built-in rules fire where they should and not where they must not; fused == unfused."""

import operator

import pytest
import torch
import torch.distributed as dist
from torch import fx

import opfuse
from opfuse import ops
from opfuse.passes import disabled_rules
from opfuse.machinery.matcher import check_legal, find_matches, graph_to_networkx
from opfuse.core.rules import get_registry

from .test_ops import randomize_


def fired(program):
    return [f.rule for f in program.fusions]


def run_both(seq, inputs, dy_seed=0):
    """Outputs and gradients (inputs and params) with fusion on and off."""
    results = []
    for fuse in (True, False):
        with opfuse.config.override(fuse=fuse):
            seq.zero_grad()
            leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
            out = seq(*leaves)
            outs = out if isinstance(out, tuple) else (out,)
            gen = torch.Generator().manual_seed(dy_seed)
            loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum() for o in outs)
            loss.backward()
            grads = [t.grad for t in leaves if t.requires_grad] + [p.grad.clone() for p in seq.parameters()]
            results.append(([o.detach() for o in outs], grads))
    return results


def assert_same(results, atol=1e-5, rtol=1e-5):
    (outs_f, grads_f), (outs_u, grads_u) = results
    for a, b in zip(outs_f, outs_u):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    for a, b in zip(grads_f, grads_u):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


H = 16


def tail_block(norm="rms", bias=True, dtype=torch.float32):
    norm_op = ops.RMSNorm(H, dtype=dtype) if norm == "rms" else ops.LayerNorm(H, dtype=dtype)
    return ops.Sequential(ops.Linear(2 * H, H, bias=bias, parallel="row", dtype=dtype), ops.AddExtraInput(),
                          ops.MakeExtraOutput(), norm_op)


@pytest.mark.parametrize("norm,rule", [("rms", "allreduce_add_rmsnorm"), ("layer", "allreduce_add_layernorm")])
@pytest.mark.parametrize("bias", [True, False])
def test_allreduce_add_norm_fires_and_matches(world1, rng, norm, rule, bias):
    seq = randomize_(tail_block(norm, bias), rng)
    x, r = torch.randn(5, 2 * H, generator=rng, requires_grad=True), torch.randn(5, H, generator=rng, requires_grad=True)
    program = opfuse.compile(seq, x, r)
    assert fired(program) == [rule]
    kinds = set(program.fusions[0].ops)
    assert {"AllReduce", "AddExtraInput", "MakeExtraOutput"} <= kinds and ("Bias" in kinds) == bias
    assert_same(run_both(seq, [x, r]))


def test_allreduce_norm_without_add(world1, rng):
    seq = randomize_(ops.Sequential(ops.Linear(2 * H, H, parallel="row"), ops.RMSNorm(H)), rng)
    x = torch.randn(3, 2 * H, generator=rng, requires_grad=True)
    program = opfuse.compile(seq, x)
    assert fired(program) == ["allreduce_add_rmsnorm"]
    assert "AddExtraInput" not in program.fusions[0].ops
    assert_same(run_both(seq, [x]))


def test_add_rmsnorm_and_plain_allreduce(world1, rng):
    seq = randomize_(ops.Sequential(ops.Linear(H, H, parallel="row"), ops.GELU(), ops.AddExtraInput(),
                                    ops.RMSNorm(H)), rng)
    x, r = torch.randn(4, H, generator=rng, requires_grad=True), torch.randn(4, H, generator=rng, requires_grad=True)
    program = opfuse.compile(seq, x, r)
    assert sorted(fired(program)) == ["add_rmsnorm", "allreduce"]
    assert_same(run_both(seq, [x, r]))


def test_sequence_parallel_rules(world1, rng):
    seq = randomize_(ops.Sequential(ops.Linear(H, 2 * H, parallel="column", sequence_parallel=True), ops.GELU(),
                                    ops.Linear(2 * H, H, parallel="row", sequence_parallel=True)), rng)
    x = torch.randn(6, H, generator=rng, requires_grad=True)
    program = opfuse.compile(seq, x)
    assert sorted(fired(program)) == ["all_gather_linear", "linear_reduce_scatter"]
    assert_same(run_both(seq, [x]))


def test_explicit_bias_before_reduce_scatter(world1, rng):
    seq = randomize_(ops.Sequential(ops.BasicLinear(H, H), ops.Bias(H), ops.ReduceScatter()), rng)
    x = torch.randn(4, H, generator=rng, requires_grad=True)
    assert fired(opfuse.compile(seq, x)) == ["linear_bias_reduce_scatter"]
    assert_same(run_both(seq, [x]))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_linear_bias_activation(rng, approximate):
    seq = randomize_(ops.Sequential(ops.Linear(H, 2 * H), ops.GELU(approximate)), rng)
    x = torch.randn(2, 3, H, generator=rng, requires_grad=True)
    assert fired(opfuse.compile(seq, x)) == ["linear_bias_activation"]
    assert_same(run_both(seq, [x]))


def test_dtype_mismatch_blocks_fusion(world1, rng):
    seq = tail_block(dtype=torch.bfloat16)
    seq[3].float()  # norm weight float32, activations bfloat16
    randomize_(seq, rng)
    x = torch.randn(3, 2 * H, generator=rng).bfloat16()
    r = torch.randn(3, H, generator=rng).bfloat16()
    program = opfuse.compile(seq, x, r)
    assert "allreduce_add_rmsnorm" not in fired(program)
    assert "allreduce" in fired(program)  # the all-reduce alone still goes through the kernels
    text = program.explain()
    assert "weight is float32, input is bfloat16" in text
    y, h = seq(x, r)
    with opfuse.config.override(fuse=False):
        y2, h2 = seq(x, r)
    torch.testing.assert_close(y, y2)


def test_rule_disabled(world1, rng):
    seq = randomize_(tail_block(), rng)
    x, r = torch.randn(3, 2 * H, generator=rng), torch.randn(3, H, generator=rng)
    with disabled_rules("allreduce_add_rmsnorm"):
        program = opfuse.compile(seq, x, r)
        assert "allreduce_add_rmsnorm" not in fired(program)
        assert "disabled by opfuse.passes.disabled_rules" in program.explain()
    assert fired(opfuse.compile(seq, x, r)) == ["allreduce_add_rmsnorm"]
    with opfuse.config.override(disabled_rules=("allreduce_add_rmsnorm", "allreduce", "add_rmsnorm")):
        assert fired(opfuse.compile(seq, x, r)) == []
    with opfuse.config.override(fuse=False):
        assert fired(opfuse.compile(seq, x, r)) == []


def test_interior_value_used_outside_blocks_fusion(world1, rng):
    """AddExtraInput -> RMSNorm with the sum also returned (without MakeExtraOutput in the
    pattern) is not legal: the interior value would be lost."""
    seq = randomize_(ops.Sequential(ops.AddExtraInput(), ops.RMSNorm(H)), rng)
    x, r = torch.randn(2, H, generator=rng), torch.randn(2, H, generator=rng)
    gm = opfuse.sequential.lower.lower(seq, (x, r))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    add = next(n for n in gm.graph.nodes if n.name == "op0_add_extra_input")
    out.args = ((out.args[0][0], add),)
    gm.recompile()
    rule = get_registry().get("add_rmsnorm")
    # Only the RMSNorm alone may be fused; no match may swallow the exported sum.
    assert all(add not in m.nodes() for m in find_matches(gm, rule))
    variant = next(v for v in rule.variants if [s.name for s in v.specs] == ["add", "norm"])
    mapping = {"add": add, "norm": next(n for n in gm.graph.nodes if n.name == "op1_rms_norm")}
    reason = check_legal(graph_to_networkx(gm), variant, mapping)
    assert "interior value op0_add_extra_input (AddExtraInput) is also used by output" in reason


def test_fusion_that_would_create_a_cycle_is_rejected():
    """Pattern {a: GELU (exported), b: AddExtraInput, a -> b[arg 1]} on a -> g -> b[arg 0]:
    fusing {a, b} would need g's value inside and g needs a's value: a cycle."""
    from opfuse.passes import OpSpec, Pattern

    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_module("a", (x,))
    g = graph.call_module("g", (a,))
    b = graph.call_module("b", (g, a))
    graph.output((b, a))
    root = torch.nn.Module()
    root.a, root.g, root.b = ops.GELU(), ops.GELU(), ops.AddExtraInput()
    gm = fx.GraphModule(root, graph)
    pattern = Pattern((OpSpec("a", "GELU", exported=True), OpSpec("b", "AddExtraInput")), (("a", "b", 1),))
    reason = check_legal(graph_to_networkx(gm), pattern, {"a": a, "b": b})
    assert reason and "cycle" in reason


def test_different_groups_block_a_rule(world1, rng):
    from opfuse.passes import OpSpec, Pattern, Replacement, register_rule, remove_rule
    from opfuse.machinery.predicates import one_group

    g1, g2 = dist.new_group([0]), dist.new_group([0])

    class GatherScatter(torch.nn.Module):
        def forward(self, x):
            return x.clone()

    register_rule(name="test_scatter_gather", where=[one_group], priority=100,
                  pattern=Pattern.chain(OpSpec("rs", "ReduceScatter"), OpSpec("ag", "AllGather")),
                  build=lambda m: Replacement(GatherScatter(), [m.input("rs")]))
    try:
        x = torch.randn(4, H, generator=rng)
        same = ops.Sequential(ops.ReduceScatter(g1), ops.AllGather(g1))
        assert fired(opfuse.compile(same, x)) == ["test_scatter_gather"]
        different = ops.Sequential(ops.ReduceScatter(g1), ops.AllGather(g2))
        program = opfuse.compile(different, x)
        assert fired(program) == []
        assert "all collectives use one process group" in program.explain()
    finally:
        remove_rule("test_scatter_gather")


def test_user_registered_rule_end_to_end(rng):
    from opfuse.passes import OpSpec, Pattern, Replacement, register_rule, remove_rule

    class BiasGelu(torch.nn.Module):
        def __init__(self, bias):
            super().__init__()
            self.bias = bias

        def forward(self, x):
            return torch.nn.functional.gelu(x + self.bias)

    @register_rule(name="test_bias_gelu", priority=50,
                   pattern=Pattern.chain(OpSpec("bias", "Bias"), OpSpec("act", "GELU")))
    def build(match):
        """bias + gelu in one module"""
        return Replacement(BiasGelu(match["bias"].op.bias), [match.input("bias")])

    try:
        rule = get_registry().get("test_bias_gelu")
        assert rule is build  # the decorator returns the registered Rule
        # Recorded where it was defined: the decorator line (co_firstlineno of a decorated function).
        assert rule.source.endswith(f"test_rules.py:{rule.build.__code__.co_firstlineno}")
        seq = randomize_(ops.Sequential(ops.BasicLinear(H, H), ops.Bias(H), ops.GELU()), rng)
        x = torch.randn(3, H, generator=rng, requires_grad=True)
        program = opfuse.compile(seq, x)
        assert fired(program) == ["test_bias_gelu"]
        assert program.fusions[0].ops == ("Bias", "GELU")
        assert "test_bias_gelu" in program.dump("python")
        assert_same(run_both(seq, [x]))
    finally:
        remove_rule("test_bias_gelu")
    assert "test_bias_gelu" not in [r.name for r in opfuse.passes.rules()]


def test_priorities_order_rules():
    names = [r.name for r in opfuse.passes.rules()]
    assert names.index("allreduce_add_rmsnorm") < names.index("add_rmsnorm") < names.index("allreduce")


def test_getitem_chain_untouched_for_multi_output_ops(world1, rng):
    seq = randomize_(tail_block(), rng)
    x, r = torch.randn(3, 2 * H, generator=rng), torch.randn(3, H, generator=rng)
    gm = opfuse.compile(seq, x, r).graph_module
    getitems = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.getitem]
    assert len(getitems) == 2
