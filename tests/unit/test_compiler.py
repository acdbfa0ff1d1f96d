"""Lowering, partitioning, the compile cache, and malformed rules."""

import pytest
import torch

import opfuse
from opfuse import ops
from opfuse.passes import OpSpec, Pattern, PatternError, Replacement, Rule, register_rule, remove_rule
from opfuse.ops.sharding import PartitionError, plan_gemm
from opfuse.ops.sharding import REPLICATED, Sharding

from .test_ops import randomize_


def kinds(gm):
    return [gm.get_submodule(n.target).kind for n in gm.graph.nodes if n.op == "call_module"]


def test_lowering_one_node_per_op_with_extra_io():
    seq = ops.Sequential(ops.RMSNorm(8), ops.AddExtraInput(), ops.MakeExtraOutput(), ops.GELU())
    x, r = torch.randn(2, 8), torch.randn(2, 8)
    gm = opfuse.sequential.lower.lower(seq, (x, r))
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders == ["x", "extra0_add_extra_input1"]
    assert kinds(gm) == ["RMSNorm", "AddExtraInput", "MakeExtraOutput", "GELU"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert [a.name for a in out.args[0]] == ["op3_gelu", "op2_make_extra_output"]
    y, h = seq(x, r)
    torch.testing.assert_close(h, seq[0](x) + r)


def test_partition_expands_linear_and_inserts_collectives(world1):
    seq = ops.Sequential(ops.RMSNorm(8), ops.Linear(8, 16, parallel="column"), ops.GELU(),
                         ops.Linear(16, 8, parallel="row"))
    x = torch.randn(3, 8)
    with opfuse.config.override(fuse=False):
        program = opfuse.compile(seq, x)
    assert kinds(program.unfused_graph_module) == ["RMSNorm", "GradAllReduce", "BasicLinear", "Bias", "GELU",
                                                   "BasicLinear", "AllReduce", "Bias"]
    # What runs: the column GEMM takes its bias inside (one rounding); the row bias follows the reduction.
    assert kinds(program.graph_module) == ["RMSNorm", "GradAllReduce", "BasicLinear", "GELU", "BasicLinear",
                                           "AllReduce", "Bias"]
    sp = ops.Sequential(ops.RMSNorm(8), ops.Linear(8, 16, parallel="column", sequence_parallel=True), ops.GELU(),
                        ops.Linear(16, 8, parallel="row", sequence_parallel=True))
    with opfuse.config.override(fuse=False):
        program = opfuse.compile(sp, x)
    assert kinds(program.unfused_graph_module) == ["RMSNorm", "AllGather", "BasicLinear", "Bias", "GELU",
                                                   "BasicLinear", "ReduceScatter", "Bias"]
    shardings = {n.name: n.meta["opfuse_sharding"].describe() for n in program.unfused_graph_module.graph.nodes
                 if "opfuse_sharding" in n.meta}
    assert shardings["x"] == "tokens-sharded"
    assert shardings["op1_linear_basic_linear"] == "features-sharded"
    assert shardings["op3_linear_basic_linear"] == "partial-sum"
    assert shardings["op3_linear_bias"] == "tokens-sharded"


def test_row_linear_with_full_width_input_slices_locally(world1):
    seq = ops.Sequential(ops.Linear(8, 8, parallel="row"))
    with opfuse.config.override(fuse=False):
        program = opfuse.compile(seq, torch.randn(2, 8))
    assert kinds(program.graph_module)[0] in ("SplitFeatures", "BasicLinear")


def test_gemm_partition_rules():
    rep = REPLICATED
    assert plan_gemm(rep, rhs_k=False, rhs_n=True, sequence_parallel=False) == (["grad_all_reduce"], None, (False, True))
    assert plan_gemm(Sharding(tokens=True), rhs_k=False, rhs_n=True, sequence_parallel=True) == (
        ["all_gather"], None, (False, True))
    assert plan_gemm(Sharding(features=True), rhs_k=True, rhs_n=False, sequence_parallel=False) == (
        [], "all_reduce", (False, False))
    assert plan_gemm(Sharding(features=True), rhs_k=True, rhs_n=False, sequence_parallel=True) == (
        [], "reduce_scatter", (True, False))
    assert plan_gemm(rep, rhs_k=True, rhs_n=False, sequence_parallel=False) == (
        ["split_features"], "all_reduce", (False, False))
    with pytest.raises(PartitionError, match="sharded on both K"):
        plan_gemm(rep, rhs_k=True, rhs_n=True, sequence_parallel=False)
    with pytest.raises(PartitionError, match="input is sharded on features"):
        plan_gemm(Sharding(features=True), rhs_k=False, rhs_n=True, sequence_parallel=False)
    with pytest.raises(PartitionError, match="partial sum"):
        plan_gemm(Sharding(partial=True), rhs_k=False, rhs_n=True, sequence_parallel=False)


def test_partition_errors_name_the_op(world1):
    x = torch.randn(2, 8)
    with pytest.raises(PartitionError, match=r"RMSNorm\(16.*a norm needs the full hidden dim"):
        ops.Sequential(ops.Linear(8, 16, parallel="column"), ops.RMSNorm(16))(x)
    with pytest.raises(PartitionError, match="use parallel='row' for a layer that follows a column-parallel one"):
        ops.Sequential(ops.Linear(8, 16, parallel="column"), ops.Linear(16, 8, parallel="column"))(x)
    import torch.distributed as dist

    other = dist.new_group([0])
    with pytest.raises(PartitionError, match="sharded over process group"):
        ops.Sequential(ops.Linear(8, 16, parallel="column"), ops.Linear(16, 8, parallel="row", group=other))(x)


def test_cache_per_signature():
    seq = ops.Sequential(ops.Linear(8, 8), ops.GELU())
    a = opfuse.compile(seq, torch.randn(2, 8))
    assert opfuse.compile(seq, torch.randn(2, 8)) is a
    assert opfuse.compile(seq, torch.randn(3, 8)) is not a
    assert opfuse.compile(seq, torch.randn(2, 8, requires_grad=True)) is not a
    with torch.no_grad():
        assert opfuse.compile(seq, torch.randn(2, 8)) is not a
    with opfuse.config.override(fuse=False):
        assert opfuse.compile(seq, torch.randn(2, 8)) is not a
    seq.append(ops.Identity())
    assert opfuse.compile(seq, torch.randn(2, 8)) is not a


def test_compile_accepts_a_single_op_and_rejects_others():
    program = opfuse.compile(ops.RMSNorm(4), torch.randn(2, 4))
    assert isinstance(program, opfuse.Program)
    with pytest.raises(TypeError, match="expected an opfuse.ops.Sequential"):
        opfuse.compile(torch.nn.Linear(2, 2), torch.randn(1, 2))


def test_malformed_rules_are_clear():
    good = Pattern.chain(OpSpec("a", "GELU"))
    with pytest.raises(PatternError, match="expected an opfuse.passes.Pattern"):
        Rule("r", "GELU", lambda m: None)
    with pytest.raises(PatternError, match="did you mean 'RMSNorm'"):
        Rule("r", Pattern.chain(OpSpec("n", "RmsNorm")), lambda m: None)
    with pytest.raises(PatternError, match="build must take one argument"):
        Rule("r", good, lambda: None)
    with pytest.raises(PatternError, match="priority='high'"):
        Rule("r", good, lambda m: None, priority="high")
    with pytest.raises(PatternError, match="expected an identifier"):
        OpSpec("not valid", "GELU")
    with pytest.raises(PatternError, match="kinds=''"):
        OpSpec("a", "")
    with pytest.raises(PatternError, match="names must be unique"):
        Pattern.chain(OpSpec("a", "GELU"), OpSpec("a", "GELU"))
    with pytest.raises(PatternError, match="cycle"):
        Pattern((OpSpec("a", "GELU"), OpSpec("b", "GELU")), (("a", "b", 0), ("b", "a", 0)))
    with pytest.raises(PatternError, match="connected"):
        Pattern((OpSpec("a", "GELU"), OpSpec("b", "GELU")), ())
    with pytest.raises(PatternError, match="at least one OpSpec must be required"):
        Pattern.chain(OpSpec("a", "GELU", optional=True))
    with pytest.raises(PatternError, match="name= and pattern= are required"):
        register_rule(build=lambda m: None)
    with pytest.raises(PatternError, match="a rule named 'allreduce' exists"):
        register_rule(name="allreduce", pattern=good, build=lambda m: None)
    with pytest.raises(KeyError, match="no rule named 'nope'"):
        remove_rule("nope")


def test_builder_returning_garbage_is_reported(rng):
    register_rule(name="test_bad_builder", priority=99, pattern=Pattern.chain(OpSpec("a", "GELU")),
                  build=lambda m: "not a replacement")
    try:
        with pytest.raises(PatternError, match="test_bad_builder.*build returned str"):
            opfuse.compile(ops.Sequential(ops.GELU()), torch.randn(2, 2))
    finally:
        remove_rule("test_bad_builder")


def test_builder_using_interior_values_is_reported():
    register_rule(name="test_interior", priority=99,
                  pattern=Pattern.chain(OpSpec("a", "GELU"), OpSpec("b", "Identity")),
                  build=lambda m: Replacement(torch.nn.Identity(), [m["a"].node]))
    try:
        with pytest.raises(PatternError, match="computed inside the match"):
            opfuse.compile(ops.Sequential(ops.GELU(), ops.Identity()), torch.randn(2, 2))
    finally:
        remove_rule("test_interior")


def test_config_env_parsing():
    from opfuse.config import Config, reload_from_env

    saved = {f: getattr(opfuse.config, f) for f in ("fuse", "disabled_rules", "symm_pool_mb")}
    try:
        reload_from_env({"OPFUSE_FUSE": "0", "OPFUSE_DISABLE_RULES": "a, b", "OPFUSE_SYMM_POOL_MB": "64"})
        assert opfuse.config.fuse is False
        assert opfuse.config.disabled_rules == ("a", "b")
        assert opfuse.config.symm_pool_mb == 64
        with pytest.raises(ValueError, match="OPFUSE_FUSE='maybe'"):
            reload_from_env({"OPFUSE_FUSE": "maybe"})
        with pytest.raises(ValueError, match="OPFUSE_SYMM_POOL_MB='-1'"):
            reload_from_env({"OPFUSE_SYMM_POOL_MB": "-1"})
        with pytest.raises(AttributeError, match="no setting 'fusee'"):
            opfuse.config.fusee = True
        with pytest.raises(TypeError, match="unknown setting"):
            with opfuse.config.override(nope=1):
                pass
    finally:
        reload_from_env({})
        for name, value in saved.items():
            setattr(opfuse.config, name, value)
    assert isinstance(opfuse.config, Config)


def test_fused_program_is_faster_path_equivalent_over_many_shapes(world1, rng):
    """Fused == unfused for several token counts and leading-dim layouts (cache per signature)."""
    seq = randomize_(ops.Sequential(ops.Linear(8, 8, parallel="row"), ops.AddExtraInput(), ops.MakeExtraOutput(),
                                    ops.RMSNorm(8)), rng)
    for shape in [(1, 8), (7, 8), (2, 3, 8)]:
        x, r = torch.randn(shape, generator=rng), torch.randn(shape, generator=rng)
        y, h = seq(x, r)
        with opfuse.config.override(fuse=False):
            y2, h2 = seq(x, r)
        torch.testing.assert_close(y, y2)
        torch.testing.assert_close(h, h2)
