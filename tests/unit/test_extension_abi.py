"""Building the CUDA modules for another interpreter (``python -m opfuse.runtime.extension --python``):
the ABI read from that interpreter decides the module's suffix and the cache folder's hash."""

import sys
import sysconfig

import pytest

from opfuse.runtime import extension


def test_this_interpreters_abi_read_through_a_subprocess_matches_the_in_process_one():
    pytest.importorskip("pybind11")
    here = extension.PythonABI.of()
    probed = extension.PythonABI.of(sys.executable)
    assert probed == here
    assert here.suffix == sysconfig.get_config_var("EXT_SUFFIX")


def test_the_cache_path_follows_the_target_abi():
    family = extension.families()[0]
    other = extension.PythonABI(".cpython-399-x86_64-linux-gnu.so", ("/nowhere",))
    default = extension._cached_path(family)
    cross = extension._cached_path(family, other)
    assert cross.endswith("_opfuse_" + family + other.suffix)
    assert cross != default and cross.rsplit("/", 2)[0] == default.rsplit("/", 2)[0]


def test_an_interpreter_that_cannot_be_read_is_a_clear_error(tmp_path):
    missing_pybind = tmp_path / "python"
    missing_pybind.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named pybind11' >&2\nexit 1\n")
    missing_pybind.chmod(0o755)
    with pytest.raises(extension.ExtensionUnavailable, match="pybind11"):
        extension.PythonABI.of(str(missing_pybind))


def test_a_missing_interpreter_is_a_clear_error(tmp_path):
    with pytest.raises(extension.ExtensionUnavailable, match="cannot run it"):
        extension.PythonABI.of(str(tmp_path / "no-such-python"))
