"""Rules that fail while a program compiles: the error names the rule and where it was defined."""

import re
import time

import pytest
import torch
from torch import nn

from opfuse import ops
from opfuse.passes import OpSpec, Pattern, Replacement, RuleError, predicate, register_rule, remove_rule


@pytest.fixture
def rule():
    """Register a rule for one test (``rule(build, *specs, where=...)``); removed afterwards."""
    names = []

    def add(build, *specs, where=()):
        name = f"test_rule_{len(names)}"
        names.append(name)
        register_rule(name=name, pattern=Pattern.chain(*(specs or (OpSpec("act", "GELU"),))), build=build,
                      where=where, priority=100)
        return name

    yield add
    for name in names:
        remove_rule(name)


def test_a_builder_that_raises_is_named(rule):
    def build(match):
        return {}["missing"]

    name = rule(build)
    with pytest.raises(RuleError, match=rf"rule '{name}' \(.*test_rule_errors.py:\d+\): its builder raised KeyError: "
                                        r"'missing' \(building the replacement of op0_gelu \(GELU\)\)"):
        ops.Sequential(ops.GELU())(torch.randn(2, 4))


def test_a_predicate_that_raises_is_named(rule):
    @predicate("input is wide")
    def wide(matched):
        return matched.input_metas[0].shape[5] > 2

    name = rule(lambda m: Replacement(ops.GELU(), [m.input("act")]), OpSpec("act", "GELU", where=[wide]))
    with pytest.raises(RuleError, match=rf"rule '{name}' \(.*test_rule_errors.py:\d+\): predicate 'input is wide' "
                                        r"on act \(op0_gelu\) raised IndexError"):
        ops.Sequential(ops.GELU())(torch.randn(2, 4))


def test_a_rule_matching_its_own_replacement_fails_fast(rule):
    name = rule(lambda m: Replacement(ops.GELU(), [m.input("act")]))
    start = time.perf_counter()
    with pytest.raises(RuleError, match=rf"rule '{name}' .* matches fused_.*, which came out of rule '{name}' itself"):
        ops.Sequential(ops.GELU())(torch.randn(2, 4))
    assert time.perf_counter() - start < 1.0


def test_two_rules_rewriting_each_other_fail_fast(rule):
    class Twin(ops.GELU):
        pass

    first = rule(lambda m: Replacement(Twin(), [m.input("act")]))
    second = rule(lambda m: Replacement(ops.GELU(), [m.input("act")]), OpSpec("act", "Twin"))
    start = time.perf_counter()
    with pytest.raises(RuleError, match=rf"rules applied to it: {first} -> {second} -> {first}"):
        ops.Sequential(ops.GELU())(torch.randn(2, 4))
    assert time.perf_counter() - start < 1.0


def test_a_chain_of_one_to_one_rewrites_is_fine(rule):
    class Faster(ops.GELU):
        pass

    class Fastest(ops.GELU):
        pass

    rule(lambda m: Replacement(Faster(), [m.input("act")]))
    rule(lambda m: Replacement(Fastest(), [m.input("act")]), OpSpec("act", "Faster"))
    block = ops.Sequential(ops.GELU())
    x = torch.randn(2, 4)
    torch.testing.assert_close(block(x), torch.nn.functional.gelu(x))
    assert [f.rule for f in block.program(x).fusions] == ["test_rule_0", "test_rule_1"]


@pytest.mark.parametrize("wrong", ["shape", "dtype"])
def test_a_replacement_with_other_metadata_is_named(rule, wrong):
    if wrong == "shape":
        make = lambda: ops.BasicLinear(4, 3)  # noqa: E731
    else:
        class Half(nn.Module):  # a plain module: checked on fake tensors
            def forward(self, x):
                return x.half()

        make = Half
    name = rule(lambda m: Replacement(make(), [m.input("act")]))
    got = "float32[2, 3]@cpu" if wrong == "shape" else "float16[2, 4]@cpu"
    with pytest.raises(RuleError, match=rf"rule '{name}' \(.*test_rule_errors.py:\d+\): its replacement \w+ computes "
                                        rf"{re.escape(got)} where the ops it replaced computed float32\[2, 4\]@cpu"):
        ops.Sequential(ops.GELU())(torch.randn(2, 4))
