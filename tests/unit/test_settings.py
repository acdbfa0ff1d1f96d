"""Settings: one validator per setting for the environment and for assignments; names checked
against the rules and the implementation table when a program is compiled."""

import os

import pytest
import torch

import opfuse
from opfuse import ops
from opfuse.machinery.implementation import ImplementationError
from opfuse.config import env_name, reload_from_env


@pytest.fixture(autouse=True)
def restore_settings():
    yield
    reload_from_env({})


@pytest.mark.parametrize("name, value, accepted", [
    ("fuse", False, False), ("verify", True, True),
    ("disabled_rules", "add_rmsnorm, allreduce", ("add_rmsnorm", "allreduce")),
    ("disabled_rules", ["add_rmsnorm"], ("add_rmsnorm",)), ("disabled_rules", "", ()),
    ("symm_pool_mb", 64, 64), ("oneshot_max_bytes", 0, 0),
    ("force_impl", " reference ", "reference"), ("force_impl", "add_rmsnorm = reference", "add_rmsnorm=reference"),
    ("force_impl", {"add_rmsnorm": "reference"}, "add_rmsnorm=reference"),
    ("overlap_alternate_streams", "ON", "on"), ("peer_timeout_ms", 0, 0),
])
def test_code_and_environment_accept_the_same_values(name, value, accepted):
    setattr(opfuse.config, name, value)
    assert getattr(opfuse.config, name) == accepted
    if isinstance(value, str):
        reload_from_env({env_name(name): value})
        assert getattr(opfuse.config, name) == accepted


@pytest.mark.parametrize("name, text, accepted", [
    ("fuse", "no", False), ("fuse", "On", True), ("verify", "1", True), ("symm_pool_mb", "64", 64),
    ("peer_timeout_ms", "0", 0),
])
def test_the_environment_gives_booleans_and_integers_as_text(name, text, accepted):
    # Code assigns the setting's own type (tests/unit/test_misuse_more.py): text is the
    # environment's.
    reload_from_env({env_name(name): text})
    assert getattr(opfuse.config, name) == accepted


@pytest.mark.parametrize("name, value, message", [
    ("fuse", "maybe", "expected True or False"),
    ("fuse", "", "expected True or False"),
    ("fuse", 2, "expected True or False"),
    ("symm_pool_mb", -5, "expected an integer >= 1"),
    ("symm_pool_mb", "0", "expected an integer >= 1"),
    ("overlap_chunks", 1.5, "expected an integer >= 0"),
    ("peer_timeout_ms", True, "expected an integer >= 0"),
    ("disabled_rules", "a;b", "separate rule names with commas"),
    ("disabled_rules", "a,,b", "an empty name between commas"),
    ("disabled_rules", 5, "expected names"),
    ("force_impl", "a=b;c=d", "separate entries with commas"),
    ("force_impl", "=reference", "entry '=reference' is not 'op=impl'"),
    ("force_impl", "add_rmsnorm=", "entry 'add_rmsnorm=' is not 'op=impl'"),
    ("force_impl", "a=b,a=c", "fused op 'a' is forced twice"),
    ("force_impl", "reference,cuda", "name the ops to force several"),
    ("overlap_alternate_streams", "sometimes", "expected one of 'auto', 'on', 'off'"),
    ("cache_dir", "", "expected a non-empty string"),
])
def test_invalid_values_name_the_setting_and_what_is_accepted(name, value, message):
    before = getattr(opfuse.config, name)
    with pytest.raises(ValueError, match=message) as caught:
        setattr(opfuse.config, name, value)
    assert f"opfuse.config.{name}={value!r}" in str(caught.value)
    assert getattr(opfuse.config, name) == before
    if isinstance(value, str):
        variable = env_name(name)
        with pytest.raises(ValueError, match=message) as caught:
            reload_from_env({variable: value})
        assert f"{variable}={value!r}" in str(caught.value)


def test_a_bad_variable_leaves_every_setting_unchanged():
    opfuse.config.fuse = False
    with pytest.raises(ValueError, match="OPFUSE_SYMM_POOL_MB"):
        reload_from_env({"OPFUSE_FUSE": "1", "OPFUSE_SYMM_POOL_MB": "lots"})
    assert opfuse.config.fuse is False


def test_a_string_does_not_disable_rules_by_substring():
    opfuse.config.disabled_rules = "allreduce_add_rmsnorm"
    assert opfuse.config.disabled_rules == ("allreduce_add_rmsnorm",)
    block = ops.Sequential(ops.AddExtraInput(), ops.RMSNorm(8))
    program = opfuse.compile(block, torch.randn(2, 8), torch.randn(2, 8))
    assert [f.rule for f in program.fusions] == ["add_rmsnorm"]


def test_unknown_rule_names_fail_at_compile():
    reload_from_env({"OPFUSE_DISABLE_RULES": "add_rmsnrom"})
    with pytest.raises(ValueError, match=r"unknown rule\(s\) \['add_rmsnrom'\]; known: .*'add_rmsnorm'"):
        ops.Sequential(ops.RMSNorm(8))(torch.randn(2, 8))


@pytest.mark.parametrize("text, message", [
    ("no_such_op=reference", r"unknown fused op 'no_such_op'; known: .*'add_rmsnorm'"),
    ("add_rmsnorm=turbo", r"fused op 'add_rmsnorm' has no implementation 'turbo'; its implementations: \['cuda', "),
    ("turbo", r"no fused op has an implementation 'turbo'; known: .*'reference'"),
])
def test_unknown_forced_names_fail_at_compile(text, message):
    reload_from_env({"OPFUSE_FORCE_IMPL": text})
    with pytest.raises(ImplementationError, match=message):
        ops.Sequential(ops.GELU())(torch.randn(2, 8))


def test_an_unwritable_dump_directory_names_the_setting(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    opfuse.config.dump_dir = str(blocker / "dumps")
    with pytest.raises(OSError, match=r"OPFUSE_DUMP / opfuse.config.dump_dir=.*cannot write the program dumps"):
        ops.Sequential(ops.GELU())(torch.randn(2, 8))
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        opfuse.config.dump_dir = str(locked)
        with pytest.raises(OSError, match="OPFUSE_DUMP"):
            ops.Sequential(ops.GELU())(torch.randn(2, 8))
