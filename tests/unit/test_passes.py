"""Registered graph passes: placement, errors at registration, disabling, provenance in fusions /
dumps / explain, failures named with the pass, verify after every registered pass, the compile
cache, and the docs/EXTENDING.md example."""

import os
import re

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import opfuse
from opfuse import ops
from opfuse.config import reload_from_env
from opfuse.passes import PassError, VerifyError, disabled_passes, passes, register_pass, remove_pass

from .test_ops import randomize_

H = 8
BUILTIN = ["partition", "horizontal_gemm", "all_gather_keep", "linear_reduce_scatter_batch", "fuse", "cleanup",
           "select_implementations", "verify"]


@pytest.fixture
def registered():
    """Names registered by the test; removed afterwards (dependents first)."""
    names = []
    yield names
    for name in reversed(names):
        if name in [p.name for p in passes()]:
            remove_pass(name)
    assert [p.name for p in passes()] == BUILTIN


def add(registered, name, fn=None, **anchors):
    def noop(gm, ctx):
        pass

    register_pass(fn or noop, name=name, **anchors)
    registered.append(name)


def block(rng):
    return randomize_(ops.Sequential(ops.RMSNorm(H), ops.Linear(H, 2 * H), ops.GELU(), ops.Linear(2 * H, H)), rng)


def kinds_seen(into):
    def watch(gm, ctx):
        into.append([ctx.kind(n) for n in gm.graph.nodes if n.op == "call_module"])
    return watch


# Placement ----------------------------------------------------------------------------------


def test_passes_run_where_they_are_placed(registered, rng):
    early, late, default = [], [], []
    add(registered, "early", kinds_seen(early), before="partition")
    add(registered, "late", kinds_seen(late), after="partition")
    add(registered, "default", kinds_seen(default))
    # after="partition" also follows what was placed after partition before it (horizontal_gemm, and
    # the passes placed after that).
    assert [p.name for p in passes()] == ["early", "partition", "horizontal_gemm", "all_gather_keep",
                                          "linear_reduce_scatter_batch", "late", "fuse", "default", "cleanup",
                                          "select_implementations", "verify"]
    seq = block(rng)
    seq(torch.randn(3, H))
    assert early == [["RMSNorm", "Linear", "GELU", "Linear"]]            # composites not yet expanded
    assert late == [["RMSNorm", "BasicLinear", "Bias", "GELU", "BasicLinear", "Bias"]]
    assert default[0][:2] == ["add_rmsnorm", "linear_bias_activation"]     # after the fusion rules


def test_same_anchor_runs_in_registration_order(registered):
    for name in ("a1", "a2"):
        add(registered, name, after="fuse")
    add(registered, "a1_then", after="a1")     # placed after a1 (and its followers), before a2
    for name in ("b1", "b2"):
        add(registered, name, before="verify")
    add(registered, "both", after="cleanup", before="select_implementations")
    names = [p.name for p in passes()]
    assert names == ["partition", "horizontal_gemm", "all_gather_keep", "linear_reduce_scatter_batch", "fuse", "a1",
                     "a1_then", "a2", "cleanup", "both", "select_implementations", "b1", "b2", "verify"]


def test_decorator_returns_the_function(registered):
    @register_pass(name="decorated", after="fuse")
    def decorated(gm, ctx):
        pass

    registered.append("decorated")
    (item,) = [p for p in passes() if p.name == "decorated"]
    assert item.run is decorated and item.source.endswith(f"test_passes.py:{decorated.__code__.co_firstlineno}")


# Errors at registration ---------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,message", [
    (dict(name="x", after="fusee"), r"no pass named 'fusee' \(did you mean 'fuse'\?\)"),
    (dict(name="x", before="nope"), r"before=: no pass named 'nope'"),
    (dict(name="fuse", after="partition"), r"a pass named 'fuse' exists \(built-in"),
    (dict(name="x", after="x"), r"cannot run after itself"),
    (dict(name="x", after="cleanup", before="fuse"), r"after='cleanup' and before='fuse' cannot both hold"),
    (dict(name="not a name", after="fuse"), r"expected a non-empty identifier-like string"),
    (dict(name="x", after=3), r"after=3; expected a pass name"),
])
def test_registration_errors(registered, kwargs, message):
    with pytest.raises(PassError, match=message):
        register_pass(lambda gm, ctx: None, **kwargs)
    assert [p.name for p in passes()] == BUILTIN


def test_malformed_pass_functions(registered):
    with pytest.raises(PassError, match=r"cannot be called as fn\(graph_module, ctx\)"):
        register_pass(lambda gm: None, name="one_arg", after="fuse")
    with pytest.raises(PassError, match="is not callable"):
        register_pass(42, name="number", after="fuse")
    add(registered, "taken", after="fuse")
    with pytest.raises(PassError, match=r"a pass named 'taken' exists \(registered at .*test_passes.py"):
        register_pass(lambda gm, ctx: None, name="taken", after="fuse")


def test_remove_errors(registered):
    add(registered, "base", after="fuse")
    add(registered, "dependent", after="base")
    with pytest.raises(PassError, match=r"'base' is the anchor of \['dependent'\]"):
        remove_pass("base")
    with pytest.raises(PassError, match="built-in pass; disable it"):
        remove_pass("cleanup")
    with pytest.raises(PassError, match="no pass named 'ghost'"):
        remove_pass("ghost")


# Disabling ----------------------------------------------------------------------------------


def test_disabled_passes_scope_and_setting(registered, rng):
    seen = []
    add(registered, "watch", kinds_seen(seen), after="fuse")
    seq, x = block(rng), torch.randn(2, H)
    with disabled_passes("watch"):
        seq(x)
    assert seen == []
    with opfuse.config.override(disabled_passes="watch"):
        seq(x)
    assert seen == []
    seq(x)
    assert len(seen) == 1
    with opfuse.config.override(disabled_passes=("fuse",)):
        assert opfuse.compile(seq, x).fusions == []
    with pytest.raises(PassError, match="'verify' cannot be disabled.*OPFUSE_VERIFY=0"):
        with disabled_passes("verify"):
            pass
    with pytest.raises(PassError, match=r"disabled_passes: no pass named 'watc' \(did you mean 'watch'\?\)"):
        with disabled_passes("watc"):
            pass
    with opfuse.config.override(disabled_passes="partition"):
        with pytest.raises(PassError, match="OPFUSE_DISABLE_PASSES / config.disabled_passes: pass 'partition' cannot"):
            seq(torch.randn(5, H))


def test_disable_passes_setting_is_validated():
    try:
        reload_from_env({"OPFUSE_DISABLE_PASSES": " horizontal_gemm , fuse "})
        assert opfuse.config.disabled_passes == ("horizontal_gemm", "fuse")
        with pytest.raises(ValueError, match="OPFUSE_DISABLE_PASSES='a,,b': an empty name"):
            reload_from_env({"OPFUSE_DISABLE_PASSES": "a,,b"})
        with pytest.raises(ValueError, match="OPFUSE_DISABLE_PASSES='a;b': 'a;b' is not a pass name"):
            reload_from_env({"OPFUSE_DISABLE_PASSES": "a;b"})
    finally:
        reload_from_env()
    with pytest.raises(ValueError, match="expected names"):
        opfuse.config.disabled_passes = 5
    with opfuse.config.override(disabled_passes="cleanup,fuse"):
        assert opfuse.config.disabled_passes == ("cleanup", "fuse")


# Provenance -----------------------------------------------------------------------------------


class TanhGelu(nn.Module):
    """A user's replacement module (plain nn.Module, not an opfuse op)."""

    def forward(self, x):
        return F.gelu(x, approximate="tanh")


def gelu_to_tanh(gm, ctx):
    for node in list(gm.graph.nodes):
        if ctx.kind(node) == "GELU" and ctx.op(node).approximate == "tanh":
            target = ctx.add_module("tanh_gelu", TanhGelu())
            with gm.graph.inserting_after(node):
                new = gm.graph.call_module(target, node.args)
            ctx.annotate(new, ctx.meta(node), ctx.sharding(node))
            ctx.record_fusion(new, [node])
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            ctx.note("replaced a GELU")


def test_recorded_fusion_in_fusions_dumps_and_explain(registered, rng, tmp_path):
    add(registered, "gelu_to_tanh", gelu_to_tanh, before="fuse")
    line = gelu_to_tanh.__code__.co_firstlineno
    seq = randomize_(ops.Sequential(ops.Linear(H, H, bias=False), ops.GELU("tanh")), rng)
    x = torch.randn(4, H, dtype=torch.float32)
    with opfuse.config.override(dump_dir=str(tmp_path)):
        program = opfuse.compile(seq, x)
    (record,) = [f for f in program.fusions if f.rule == "gelu_to_tanh"]
    assert record.by == "pass" and record.ops == ("GELU",) and record.source.endswith(f"test_passes.py:{line}")
    assert str(record).startswith(f"{record.fused_node}: pass gelu_to_tanh [")
    code = program.dump("python")
    assert re.search(rf"tanh_gelu\(.*pass gelu_to_tanh at \S*test_passes.py:{line}; impl=\?; covers op1_gelu", code)
    assert "gelu_to_tanh" in program.dump("html")
    text = program.explain()
    assert f"pass gelu_to_tanh [" in text and "pass notes:\n  gelu_to_tanh: replaced a GELU" in text
    torch.testing.assert_close(program(x), F.gelu(x @ seq[0].weight.T, approximate="tanh"))
    stems = sorted(f for f in os.listdir(next(tmp_path.iterdir())) if f.endswith(".py"))
    assert stems[:6] == ["00_lowered.py", "01_partition.py", "02_horizontal_gemm.py", "03_all_gather_keep.py",
                         "04_linear_reduce_scatter_batch.py", "05_gelu_to_tanh.py"]


def test_a_pass_that_raises_is_named(registered, rng):
    def broken(gm, ctx):
        raise KeyError("no such node")

    add(registered, "broken", broken, after="fuse")
    line = broken.__code__.co_firstlineno
    with pytest.raises(PassError, match=rf"pass 'broken' \(\S*test_passes.py:{line}\) raised KeyError: 'no such node'") as info:
        block(rng)(torch.randn(2, H))
    assert isinstance(info.value.__cause__, KeyError)


# Verify after every registered pass ---------------------------------------------------------------


def _widen_bias_input(gm, ctx):
    """Feed the last Bias the block input (H features) instead of its GEMM (2H): a shape bug."""
    nodes = list(gm.graph.nodes)
    bias = [n for n in nodes if ctx.kind(n) == "Bias"][0]
    bias.args = (nodes[0],)


def _no_meta(gm, ctx):
    node = [n for n in gm.graph.nodes if ctx.kind(n) == "GELU"][0]
    with gm.graph.inserting_after(node):
        new = gm.graph.call_function(torch.neg, (node,))
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)


def _dangling(gm, ctx):
    other = fx.Graph()
    stranger = other.placeholder("stranger")
    node = [n for n in gm.graph.nodes if ctx.kind(n) == "GELU"][0]
    node.args = (stranger,)


def _wrong_layout(gm, ctx):
    from opfuse.ops import Sharding

    node = [n for n in gm.graph.nodes if ctx.kind(n) == "GELU"][0]
    node.meta["opfuse_sharding"] = Sharding(features=True)


@pytest.mark.parametrize("bug,message", [
    (_widen_bias_input, r"op1_linear_bias \(Bias\) has invalid inputs: Bias\(features=16\): input has 8 features"),
    (_no_meta, r"neg has no tensor metadata; annotate new nodes with ctx.annotate"),
    (_dangling, r"graph lint failed"),
    (_wrong_layout, r"op2_gelu \(GELU\) is recorded as features-sharded but its inputs make it replicated"),
])
def test_verify_names_the_pass_that_broke_the_graph(registered, rng, tmp_path, bug, message):
    add(registered, "buggy", bug, after="partition")
    line = bug.__code__.co_firstlineno
    seq, x = block(rng), torch.randn(2, H)
    with opfuse.config.override(dump_dir=str(tmp_path)):
        with pytest.raises(VerifyError, match=rf"after pass 'buggy' \(\S*test_passes.py:{line}\): .*{message}"):
            seq(x)
    dumped = os.listdir(next(tmp_path.iterdir()))
    assert "05_buggy.py" in dumped  # the broken graph, for debugging


def test_verify_off_skips_the_checks(registered, rng):
    add(registered, "buggy", _wrong_layout, after="partition")
    with opfuse.config.override(verify=False):
        block(rng)(torch.randn(2, H))


# The compile cache --------------------------------------------------------------------------------


def test_compile_cache_keys_on_the_pass_list(registered, rng):
    seen = []
    seq, x = block(rng), torch.randn(2, H)
    first = opfuse.compile(seq, x)
    assert opfuse.compile(seq, x) is first
    add(registered, "watch", kinds_seen(seen), after="fuse")
    second = opfuse.compile(seq, x)
    assert second is not first and len(seen) == 1
    assert opfuse.compile(seq, x) is second and len(seen) == 1
    with disabled_passes("watch"):
        third = opfuse.compile(seq, x)
    assert third is not second and len(seen) == 1
    remove_pass("watch")
    registered.remove("watch")
    assert opfuse.compile(seq, x) not in (first, second, third) and len(seen) == 1


# The docs/EXTENDING.md example -------------------------------------------------------------------


def doc_section(title):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "EXTENDING.md")) as handle:
        text = handle.read()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_extending_writing_a_pass_example_runs(registered, rng):
    section = doc_section("(v) A graph pass")
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)[:1]
    namespace = {}
    exec(compile(code, "docs/EXTENDING.md (A graph pass)", "exec"), namespace)
    registered.extend(n for n in [p.name for p in passes()] if n not in BUILTIN)


def test_batch_above_one_sequence_fusions_stay_off_for_cuda_tensors_under_async_tp():
    """The batch > 1 gather fusion (all_gather_keep's regroup) is off for CUDA tensors while Inductor's
    async TP is on (the pair gave wrong k/v weight gradients at batch 4 on GPUs; each alone was right),
    and explain() says so; CPU values are unaffected."""
    from torch import fx
    from torch._inductor import config as inductor_config

    from opfuse.core.passes.sequence_batch import batch_fusion_refused
    from opfuse.ops.base import TensorMeta

    class Ctx:
        def __init__(self, device):
            self.device, self.notes = device, []

        def meta(self, node):
            return TensorMeta((8, 4), torch.bfloat16, torch.device(self.device))

        def note(self, message):
            self.notes.append(message)

    node = fx.Graph().placeholder("gathered")
    for async_tp in (False, True):
        with inductor_config.patch(_micro_pipeline_tp=async_tp):
            cpu, cuda = Ctx("cpu"), Ctx("cuda")
            assert not batch_fusion_refused(cpu, node, "all-gather + GEMM") and not cpu.notes
            assert batch_fusion_refused(cuda, node, "all-gather + GEMM") == async_tp
            assert bool(cuda.notes) == async_tp
    assert "gathered: all-gather + GEMM at batch > 1 left unfused on CUDA tensors while Inductor's async TP" \
        in cuda.notes[0]
    from opfuse.core.passes.sequence_batch import refusal_lifted

    with inductor_config.patch(_micro_pipeline_tp=True):
        with refusal_lifted():  # the diagnosis tools' way to compile the pair
            assert not batch_fusion_refused(Ctx("cuda"), node, "all-gather + GEMM")
        with refusal_lifted(False):
            assert batch_fusion_refused(Ctx("cuda"), node, "all-gather + GEMM")
