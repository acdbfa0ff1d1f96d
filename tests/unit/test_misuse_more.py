"""Misuse answered with an error naming the value and what is accepted (issue 29, item 5), one
process: settings of the wrong type, a forced implementation a direct call cannot run, compiling a
compiled model, asking for programs before anything compiled, a rule's replacement arguments,
sync_sequence_parallel_grads at the wrong time, and ``dump -o`` to a path that cannot be written.
The checks that need several ranks are in tests/dist/test_misuse_more.py."""

import dataclasses
import os

import pytest
import torch

import opfuse
from opfuse import ops
from opfuse.__main__ import main
from opfuse.machinery.implementation import ImplementationError
from opfuse.config import Config, reload_from_env
from opfuse.passes import OpSpec, Pattern, Replacement, register_rule, remove_rule
from opfuse.machinery.rule import RuleError


@pytest.fixture(autouse=True)
def restore_settings():
    yield
    reload_from_env({})


# Settings ------------------------------------------------------------------------------------


def test_config_fuse_refuses_text_in_code():
    with pytest.raises(ValueError, match=r"opfuse.config.fuse='no': expected True or False \(a bool; text such as "
                                         r"'no' is read only from the environment variable\)"):
        opfuse.config.fuse = "no"
    assert opfuse.config.fuse is True


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Config)])
def test_every_setting_refuses_values_of_another_type_in_code(name):
    default = getattr(opfuse.config, name)
    if isinstance(default, bool):
        wrong = ["no", "1", 1, 0, None, 1.0]
    elif isinstance(default, int):
        wrong = ["64", True, 1.5, None]
    elif isinstance(default, tuple):
        wrong = [5, None, {"a": 1}]
    else:  # text settings: strings (or a mapping for force_impl)
        wrong = [5, None, True]
    for value in wrong:
        with pytest.raises(ValueError, match=rf"opfuse.config.{name}={value!r}: expected") as caught:
            setattr(opfuse.config, name, value)
        assert getattr(opfuse.config, name) == default, (name, value, str(caught.value))


def test_check_replicated_is_a_setting_with_three_values():
    opfuse.config.check_replicated = "always"
    reload_from_env({"OPFUSE_CHECK_REPLICATED": "off"})
    assert opfuse.config.check_replicated == "off"
    with pytest.raises(ValueError, match=r"expected one of 'compile', 'always', 'off'"):
        opfuse.config.check_replicated = "sometimes"


# A forced implementation, called directly -----------------------------------------------------


def test_a_forced_grouped_implementation_is_refused_alike_called_directly_or_in_a_block():
    layer = ops.GroupedLinear(2, 8, 4)
    x, sizes = torch.randn(5, 8), torch.tensor([2, 3])
    with opfuse.config.override(force_impl="grouped_linear=triton"):
        for call in (lambda: layer(x, sizes), lambda: ops.Sequential(layer)(x, sizes)):
            with pytest.raises(ImplementationError, match=r"^grouped_linear: forced implementation 'triton' cannot "
                                                          r"run: "):
                call()
        with pytest.raises(ImplementationError, match=r"called directly runs its reference math .* "
                                                      r"ops.Sequential\(layer\)\(x, group_sizes\)"):
            layer(x, sizes)
    with opfuse.config.override(force_impl="grouped_linear=reference"):
        torch.testing.assert_close(layer(x, sizes), ops.Sequential(layer)(x, sizes))


# torch.compile front end ----------------------------------------------------------------------


def test_optimizing_a_compiled_model_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    compiled = opfuse.optimize(model, options={"inductor": False})
    with pytest.raises(TypeError, match=r"opfuse.optimize: the model is already compiled \(OptimizedModule, from "
                                        r"opfuse.optimize or torch.compile\); pass the original model"):
        opfuse.optimize(compiled)
    with pytest.raises(TypeError, match="already compiled"):
        opfuse.optimize(torch.compile(lambda x: x * 2, backend="eager"))


def test_programs_before_the_first_call_say_that_nothing_compiled_yet():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    compiled = opfuse.optimize(model, options={"inductor": False})
    with pytest.raises(RuntimeError, match=r"opfuse.programs: nothing compiled yet for this OptimizedModule: "
                                           r"torch.compile compiles a graph when the model is first called"):
        opfuse.programs(compiled)
    compiled(torch.randn(2, 8))
    assert len(opfuse.programs(compiled)) == 1


# Rules ----------------------------------------------------------------------------------------


class _Gelu(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.gelu(x)


@pytest.mark.parametrize("args, what", [
    (["not a node"], r"Replacement.args\[0\] is 'not a node', a str \(a node's name is not its value\)"),
    ([torch.ones(2)], r"Replacement.args\[0\] is tensor\(\[1., 1.\]\), a Tensor"),
])
def test_replacement_args_are_checked_and_the_error_names_the_rule(args, what):
    @register_rule(name="issue29_bad_args", priority=99, pattern=Pattern.chain(OpSpec("act", "GELU")))
    def build(match):
        return Replacement(_Gelu(), args=args)

    line = build.source.rsplit(":", 1)[1]
    try:
        with pytest.raises(RuleError, match=rf"rule 'issue29_bad_args' \(.*test_misuse_more.py:{line}\): {what}; "
                                            r"accepted: values of the matched graph"):
            ops.Sequential(ops.GELU())(torch.randn(2, 4))
    finally:
        remove_rule("issue29_bad_args")


# sync_sequence_parallel_grads -----------------------------------------------------------------


def test_sync_sequence_parallel_grads_on_a_block_that_is_not_sequence_parallel_warns(world1):
    block = ops.Sequential(ops.Linear(8, 8, parallel="column"), ops.Linear(8, 8, parallel="row"))
    block(torch.randn(2, 8)).sum().backward()
    with pytest.warns(UserWarning, match=r"no parameter of this Sequential acts on token-sharded activations, "
                                         r"nothing to reduce"):
        assert opfuse.sync_sequence_parallel_grads(block) == 0


def test_sync_sequence_parallel_grads_before_backward_or_twice_raises(world1):
    block = ops.Sequential(ops.RMSNorm(8), ops.Linear(8, 8, parallel="column", sequence_parallel=True))
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="blocks with sequence_parallel=True mark theirs when they compile"):
        opfuse.sync_sequence_parallel_grads(block)  # not called yet: nothing marked
    y = block(x)
    with pytest.raises(RuntimeError, match=r"none of the 1 sequence-parallel parameters of this Sequential has a "
                                           r"gradient yet; call it after loss.backward\(\)"):
        opfuse.sync_sequence_parallel_grads(block)
    y.sum().backward()
    assert opfuse.sync_sequence_parallel_grads(block) == 1
    with pytest.raises(RuntimeError, match=r"already reduced and have not changed since .* once after each backward"):
        opfuse.sync_sequence_parallel_grads(block)
    block(x).sum().backward()  # accumulates into the same gradient tensors
    assert opfuse.sync_sequence_parallel_grads(block) == 1


# python -m opfuse dump -o ---------------------------------------------------------------------


@pytest.mark.parametrize("where", ["directory", "missing parent", "under a file"])
def test_dump_checks_its_output_path_before_starting(tmp_path, capsys, where):
    (tmp_path / "file").write_text("x")
    path = {"directory": tmp_path, "missing parent": tmp_path / "nope" / "out.py",
            "under a file": tmp_path / "file" / "out.py"}[where]
    reason = {"directory": "is a directory", "missing parent": "does not exist",
              "under a file": "is not a directory"}[where]
    with pytest.raises(SystemExit) as exited:
        main(["dump", "-o", str(path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m opfuse dump: error: -o/--output {str(path)!r}: ") and reason in err, err
    assert err.strip().endswith("expected a writable file path") and len(err.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "nope")


def test_sequence_parallel_fused_ops_refuse_bad_arguments():
    """The fused ops the compile passes build for sequence parallelism name what they accept."""
    from torch import nn

    from opfuse.families.collective_linear.keep import AllGatherLinearKeep
    from opfuse.families.collective_linear.op import LinearReduceScatter

    w = nn.Parameter(torch.randn(4, 3))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=rf"batch={bad!r}; expected a positive int"):
            AllGatherLinearKeep([w], batch=bad)
        with pytest.raises(ValueError, match=rf"batch={bad!r}; expected a positive int"):
            LinearReduceScatter(weight=w, batch=bad)
    with pytest.raises(ValueError, match="needs at least one weight"):
        AllGatherLinearKeep([])
    with pytest.raises(ValueError, match="2 weights but 1 biases"):
        AllGatherLinearKeep([w, w], [nn.Parameter(torch.zeros(4))])
    keep = AllGatherLinearKeep([w])
    with pytest.raises(RuntimeError, match="all_gather_linear_keep has no backward"):
        keep(torch.randn(2, 3, requires_grad=True))



def test_optimize_refuses_what_is_not_a_model():
    with pytest.raises(TypeError, match=r"opfuse.optimize: model is a str; expected a torch.nn.Module or a function"):
        opfuse.optimize("model")


@pytest.mark.parametrize("make", [
    lambda: opfuse.ops.Linear(4, 4, bias="yes"),
    lambda: opfuse.ops.Linear(4, 4, parallel="row", sequence_parallel=1),
    lambda: opfuse.ops.GatedLinear(4, 4, bias=None),
    lambda: opfuse.ops.GroupedLinear(2, 4, 4, bias="x"),
], ids=["linear-bias", "linear-sequence-parallel", "gated-bias", "grouped-bias"])
def test_linear_flags_must_be_booleans(make):
    """``bias="yes"`` was taken as truthy: a flag of another type is an error naming it."""
    with pytest.raises(TypeError, match=r"=('yes'|1|None|'x'); expected True or False"):
        make()
