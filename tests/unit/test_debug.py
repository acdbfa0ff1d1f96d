"""Dumps (python / text / dot / html), explain, OPFUSE_DUMP, and the custom ops' contracts."""

import ast
import os

import pytest
import torch

import opfuse
from opfuse import ops

from .test_ops import randomize_

H = 8


@pytest.fixture
def tail(world1, rng):
    seq = randomize_(ops.Sequential(ops.Linear(2 * H, H, parallel="row"), ops.AddExtraInput(), ops.MakeExtraOutput(),
                                    ops.RMSNorm(H)), rng)
    x, r = torch.randn(3, 2 * H, generator=rng), torch.randn(3, H, generator=rng)
    return seq, x, r


def test_python_dump_is_runnable_and_names_rules(tail):
    seq, x, r = tail
    program = opfuse.compile(seq, x, r)
    code = program.dump("python")
    ast.parse(code)
    assert "fused_allreduce_add_rmsnorm" in code and "rule allreduce_add_rmsnorm at" in code
    assert "rules.py:" in code and "impl=reference" in code
    namespace = {}
    exec(compile(code, "<dump>", "exec"), namespace)
    y, h = namespace["forward"](program.graph_module, x, r)
    y2, h2 = seq(x, r)
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(h, h2)
    before = program.dump("python", graph="unfused")
    ast.parse(before)
    assert "op0_linear_all_reduce" in before and "fused_" not in before


def test_text_dot_html_dumps(tail):
    seq, x, r = tail
    program = opfuse.compile(seq, x, r)
    text = program.dump("text", graph="both")
    assert "before fusion" in text and "after fusion" in text and "allreduce_add_rmsnorm" in text
    dot = program.dump("dot", graph="both")
    assert dot.startswith("digraph opfuse {") and "cluster_before" in dot and "cluster_after" in dot
    assert dot.count("{") == dot.count("}")
    page = program.dump("html", graph="both")
    assert page.startswith("<!doctype html>") and page.count("<svg") == 2 and "allreduce_add_rmsnorm" in page
    with pytest.raises(ValueError, match="format 'svg'"):
        program.dump("svg")


def test_explain_lists_near_misses_with_the_failed_predicate(world1, rng):
    seq = ops.Sequential(ops.AddExtraInput(), ops.MakeExtraOutput(), ops.RMSNorm(H))
    seq[2].double()
    x, r = torch.randn(2, H), torch.randn(2, H)
    text = opfuse.compile(seq, x, r).explain()
    assert "add_rmsnorm" in text
    assert "matched 2/3" in text and "predicate failed: norm parameters have the activation dtype" in text
    assert "weight is float64, input is float32" in text


def test_explain_reports_shadowed_rules(world1, rng):
    seq = randomize_(ops.Sequential(ops.Linear(H, H, parallel="row"), ops.AddExtraInput(), ops.RMSNorm(H)), rng)
    text = opfuse.compile(seq, torch.randn(2, H), torch.randn(2, H)).explain(verbose=True)
    assert "fusions:" in text and "allreduce_add_rmsnorm" in text
    assert "shadowed" in text  # add_rmsnorm and allreduce both matched ops the bigger rule took


def test_opfuse_dump_env_writes_every_pass(tail, tmp_path):
    seq, x, r = tail
    with opfuse.config.override(dump_dir=str(tmp_path)):
        seq(x, r)
    (program_dir,) = list(tmp_path.iterdir())
    files = sorted(os.listdir(program_dir))
    stems = [f.split(".")[0] for f in files if f.endswith(".py")]
    assert stems == ["00_lowered", "01_partition", "02_horizontal_gemm", "03_all_gather_keep",
                     "04_linear_reduce_scatter_batch", "05_fuse", "06_cleanup", "07_select_implementations", "08_verify"]
    assert "explain.txt" in files
    for name in files:
        if name.endswith(".py"):
            ast.parse((program_dir / name).read_text())


def test_custom_ops_pass_opcheck(world1, rng):
    """Schemas, fake (meta) implementations and autograd registrations are consistent."""
    from opfuse.ops import group as groups

    name = groups.group_name(None)
    x = torch.randn(4, H, generator=rng, requires_grad=True)
    r = torch.randn(4, H, generator=rng, requires_grad=True)
    w = torch.randn(H, generator=rng, requires_grad=True)
    b = torch.randn(H, generator=rng, requires_grad=True)
    torch.library.opcheck(torch.ops.opfuse.allreduce_add_rmsnorm.default,
                          (x, b, r, w, None, 1e-6, name, True, "reference"))
    torch.library.opcheck(torch.ops.opfuse.add_layernorm.default, (x, None, r, w, b, 1e-5, "", True, "reference"))
    torch.library.opcheck(torch.ops.opfuse.allreduce.default, (x, b, None, None, None, 1e-6, name, False, "reference"))
    weight = torch.randn(6, H, generator=rng, requires_grad=True)
    bias6 = torch.randn(6, generator=rng, requires_grad=True)
    torch.library.opcheck(torch.ops.opfuse.all_gather_linear.default, (x, weight, bias6, name, "reference"))
    torch.library.opcheck(torch.ops.opfuse.linear_reduce_scatter.default, (x, weight, bias6, True, name, "reference"))
    torch.library.opcheck(torch.ops.opfuse.linear_bias_activation.default,
                          (x, weight, bias6, "gelu", True, "reference"))


def test_torch_compile_can_trace_a_program(world1, rng):
    seq = randomize_(ops.Sequential(ops.Linear(H, 2 * H), ops.GELU(), ops.Linear(2 * H, H), ops.AddExtraInput(),
                                    ops.RMSNorm(H)), rng)
    x, r = torch.randn(3, H, generator=rng), torch.randn(3, H, generator=rng)
    program = opfuse.compile(seq, x, r)
    compiled = torch.compile(program.graph_module, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, r)[0], seq(x, r))
