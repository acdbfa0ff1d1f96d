"""opfuse.log: quiet by default, OPFUSE_LOG=info|debug prints why a call was slow (the nvcc
build, pool growth, fallbacks, recompiles), bad values are rejected with the accepted ones."""

import logging
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

import opfuse
from opfuse import log
from opfuse.config import reload_from_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def emit_everything():
    log.extension_build("/cache/ext/abc/_opfuse_cuda.so", lambda: "built")
    log.extension_cached("/cache/ext/abc/_opfuse_cuda.so")
    log.pool_growth("0", 512, 1024, 4096, "reserve allreduce_add_norm")
    log.fallback("allreduce_add_norm", "reference", [("cuda_oneshot", "no CUDA device")])
    log.fallback("grouped_linear", "triton", [])
    log.recompile("Sequential(RMSNorm, Linear)", "new input signature float32[4, 8]")


def lines_at(level: str, capsys) -> list[str]:
    """What opfuse printed at ``level``, with the rank prefix written as ``opfuse[rank R]`` (other
    tests of this process may have initialised a process group)."""
    with opfuse.config.override(log=level):
        emit_everything()
    rank = str(dist.get_rank()) if dist.is_initialized() else "-"
    return capsys.readouterr().err.replace(f"opfuse[rank {rank}]", "opfuse[rank R]").splitlines()


def test_quiet_by_default(capsys):
    assert opfuse.config.log == "warning"
    assert lines_at("warning", capsys) == []
    assert log.logger.propagate  # an application's own handlers still see opfuse's warnings


def test_info_shows_what_costs_time(capsys):
    lines = lines_at("info", capsys)
    assert lines == [
        "opfuse[rank R] INFO opfuse.build: building the CUDA extension with nvcc (first use on this host; cached "
        "afterwards): /cache/ext/abc/_opfuse_cuda.so",
        lines[1],
        "opfuse[rank R] INFO opfuse.pool: symmetric pool of group 0 grew by 512 MiB to 1024 MiB (limit 4096 MiB): "
        "reserve allreduce_add_norm",
        "opfuse[rank R] INFO opfuse.dispatch: allreduce_add_norm: running reference; skipped cuda_oneshot "
        "(no CUDA device)",
        "opfuse[rank R] INFO opfuse.compile: compiling Sequential(RMSNorm, Linear): new input signature float32[4, 8]",
    ]
    assert lines[1].startswith("opfuse[rank R] INFO opfuse.build: built the CUDA extension in ")


def test_debug_adds_cache_hits_and_first_choices(capsys):
    lines = "\n".join(lines_at("debug", capsys))
    assert "DEBUG opfuse.build: CUDA extension cache hit: /cache/ext/abc/_opfuse_cuda.so" in lines
    assert "DEBUG opfuse.dispatch: grouped_linear: running triton (first choice)" in lines
    # Back to quiet: our handler is gone, the logger propagates again.
    assert lines_at("warning", capsys) == [] and log.logger.propagate


def test_failed_build_is_a_warning_even_when_quiet(caplog):
    def broken():
        raise RuntimeError("nvcc failed on norm.cu\nlong compiler output")

    with caplog.at_level(logging.WARNING, logger="opfuse"), pytest.raises(RuntimeError):
        log.extension_build("/x.so", broken)
    assert [r.getMessage() for r in caplog.records][-1].endswith("s: nvcc failed on norm.cu")


def test_setting_is_validated():
    with pytest.raises(ValueError, match=r"OPFUSE_LOG='loud': expected one of 'warning', 'info', 'debug'"):
        reload_from_env({"OPFUSE_LOG": "loud"})
    with pytest.raises(ValueError, match=r"opfuse.config.log='verbose': expected one of 'warning', 'info', 'debug'"):
        opfuse.config.log = "verbose"
    reload_from_env({"OPFUSE_LOG": "DEBUG"})
    try:
        assert opfuse.config.log == "debug"
    finally:
        reload_from_env()


def test_env_variable_reaches_a_fresh_process():
    code = "import opfuse.log as l; l.recompile('block', 'settings changed')"
    env = dict(os.environ, PYTHONPATH=ROOT, OPFUSE_LOG="info")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "opfuse[rank -] INFO opfuse.compile: compiling block: settings changed" in result.stderr


def test_the_core_logs_fallbacks_and_recompiles(capsys, world1):
    """The call sites: a fused op choosing a slower implementation (on CPU every kernel is
    skipped, the reference runs) and a block compiling for a second input signature."""
    import torch

    from opfuse import ops

    block = ops.Sequential(ops.Linear(8, 8, parallel="row"), ops.AddExtraInput(), ops.MakeExtraOutput(),
                           ops.RMSNorm(8))
    with opfuse.config.override(log="info"):
        block(torch.randn(2, 8), torch.randn(2, 8))
        block(torch.randn(3, 8), torch.randn(3, 8))
    err = capsys.readouterr().err
    assert "INFO opfuse.dispatch: allreduce_add_rmsnorm: running reference; skipped cuda_oneshot (needs a CUDA " \
           "device)" in err, err
    assert "INFO opfuse.compile: compiling Sequential: a new input signature" in err, err
