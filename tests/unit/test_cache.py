"""The compile cache: every change a program depends on recompiles it, nothing else does, and the
per-call guard stays a handful of comparisons."""

import pytest
import torch
import torch.nn.functional as F

import opfuse
from opfuse import ops
from opfuse.ops.base import OpInputError

from .test_ops import randomize_


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def test_appending_after_a_call_runs_the_new_ops(rng):
    block = ops.Sequential(ops.RMSNorm(8))
    x = torch.randn(3, 8, generator=rng)
    block(x)
    block += ops.Sequential(ops.GELU())
    assert type(block) is ops.Sequential and len(block) == 2
    torch.testing.assert_close(block(x), F.gelu(block[0](x)))
    block.extend(ops.Sequential(ops.Identity(), ops.GELU()))
    torch.testing.assert_close(block(x), F.gelu(F.gelu(block[0](x))))
    block.insert(0, ops.GELU())
    torch.testing.assert_close(block(x), F.gelu(F.gelu(block[1](F.gelu(x)))))
    del block[0]
    block.pop(-1)
    torch.testing.assert_close(block(x), F.gelu(block[0](x)))


def test_concatenating_and_repeating_give_opfuse_blocks(rng):
    a, b = ops.Sequential(ops.RMSNorm(8)), ops.Sequential(ops.GELU())
    x = torch.randn(3, 8, generator=rng)
    both = a + b
    assert type(both) is ops.Sequential and [op.kind for op in both] == ["RMSNorm", "GELU"]
    torch.testing.assert_close(both(x), F.gelu(a(x)))
    twice = b * 2
    assert type(twice) is ops.Sequential and len(twice) == 2
    torch.testing.assert_close(twice(x), F.gelu(F.gelu(x)))
    b(x)
    b *= 3
    torch.testing.assert_close(b(x), F.gelu(F.gelu(F.gelu(x))))
    with pytest.raises(TypeError, match="element"):
        a.append(torch.nn.GELU())


@pytest.mark.parametrize("fuse", [True, False])
def test_changing_an_op_attribute_recompiles(fuse, rng):
    block = randomize_(ops.Sequential(ops.AddExtraInput(), ops.MakeExtraOutput(), ops.RMSNorm(8, eps=1e-6)), rng)
    x, r = torch.randn(3, 8, generator=rng), torch.randn(3, 8, generator=rng)
    with opfuse.config.override(fuse=fuse):
        block(x, r)
        first = opfuse.compile(block, x, r)
        block[2].eps = 0.5
        y, h = block(x, r)
        torch.testing.assert_close(y, rms(x + r, block[2].weight, 0.5))
        assert opfuse.compile(block, x, r) is not first


def test_changing_a_parameter_object_or_the_dtype_recompiles(rng):
    block = ops.Sequential(ops.Linear(8, 8), ops.RMSNorm(8))
    x = torch.randn(2, 8, generator=rng)
    block(x)
    block[0].weight = torch.nn.Parameter(torch.randn(8, 8, generator=rng))
    torch.testing.assert_close(block(x), block[1](F.linear(x, block[0].weight, block[0].bias)))
    block.double()
    xd = x.double()
    torch.testing.assert_close(block(xd), block[1](F.linear(xd, block[0].weight, block[0].bias)))
    with pytest.raises(OpInputError, match="input dtype float32 differs from the parameter dtype float64"):
        block(x)
    block[0].weight = torch.nn.Parameter(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(OpInputError, match=r"Linear\(in_features=8.*weight has shape \[4, 8\], expected \[8, 8\]"):
        block(xd)


def test_a_parameter_data_swap_is_reported_by_the_op(rng):
    block = ops.Sequential(ops.Linear(8, 8), ops.GELU())
    x = torch.randn(2, 8, generator=rng)
    block(x)
    block[0].weight.data = torch.randn(8, 8, dtype=torch.float64)  # invisible to the guard
    with pytest.raises(OpInputError, match="differs from the parameter dtype float64.*the block changed after"):
        block(x)


def test_requires_grad_of_parameters_is_part_of_the_key(rng):
    block = randomize_(ops.Sequential(ops.AddExtraInput(), ops.RMSNorm(8)), rng)
    x, r = torch.randn(3, 8, generator=rng), torch.randn(3, 8, generator=rng)
    for p in block.parameters():
        p.requires_grad_(False)
    block(x, r)
    for p in block.parameters():
        p.requires_grad_(True)
    block(x, r).sum().backward()
    assert block[1].weight.grad is not None


def test_settings_and_rules_recompile_and_come_back(rng):
    block = ops.Sequential(ops.AddExtraInput(), ops.MakeExtraOutput(), ops.RMSNorm(8))
    x, r = torch.randn(3, 8, generator=rng), torch.randn(3, 8, generator=rng)
    fused = opfuse.compile(block, x, r)
    with opfuse.config.override(fuse=False):
        assert opfuse.compile(block, x, r).fusions == []
    # Back to the old value: the programs of that state are compiled again, not piling up.
    again = opfuse.compile(block, x, r)
    assert [f.rule for f in again.fusions] == [f.rule for f in fused.fusions]
    assert len(block._programs) == 1
    with opfuse.passes.disabled_rules("add_rmsnorm"):
        assert opfuse.compile(block, x, r).fusions == []
    rule = next(r for r in opfuse.passes.rules() if r.name == "add_rmsnorm")
    rule.enabled = False
    try:
        assert opfuse.compile(block, x, r).fusions == []
    finally:
        rule.enabled = True


def test_a_call_with_unchanged_inputs_skips_the_lookup(rng, monkeypatch):
    block = ops.Sequential(ops.RMSNorm(8), ops.GELU())
    x = torch.randn(2, 8, generator=rng)
    block(x)
    from opfuse.sequential import block as sequential

    lookups = []
    original = sequential.Sequential._lookup
    monkeypatch.setattr(sequential.Sequential, "_lookup", lambda self, inputs: lookups.append(1) or original(self, inputs))
    for _ in range(3):
        block(x)
    assert lookups == []
    block(torch.randn(5, 8))
    block(x.requires_grad_())
    with torch.no_grad():
        block(x)
    assert len(lookups) == 3


def test_program_callable_matches_graph_module(rng):
    block = randomize_(ops.Sequential(ops.Linear(8, 8), ops.AddExtraInput(), ops.MakeExtraOutput(), ops.RMSNorm(8)),
                       rng)
    x, r = torch.randn(3, 8, generator=rng), torch.randn(3, 8, generator=rng)
    program = opfuse.compile(block, x, r)
    assert "def program(" in program.run.source
    for got, want in zip(program(x, r), program.graph_module(x, r)):
        torch.testing.assert_close(got, want)


def test_train_eval_and_a_no_op_to_keep_the_programs(rng):
    block = ops.Sequential(ops.Linear(8, 8), ops.RMSNorm(8))
    x = torch.randn(2, 8, generator=rng)
    program = opfuse.compile(block, x)
    block.eval()
    block.train()
    block.to(torch.float32)
    block.to("cpu")
    assert opfuse.compile(block, x) is program
    block.to(torch.float64)
    assert opfuse.compile(block, x.double()) is not program
