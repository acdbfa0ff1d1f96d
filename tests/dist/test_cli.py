"""The README commands' entry points: ``python -m opfuse demo`` and ``dump`` (2 gloo processes)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "opfuse", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.dist
def test_demo_reports_check_passed():
    result = run_cli("demo", "--world", "2")
    assert result.returncode == 0, result.stderr
    assert "result: check PASSED" in result.stdout
    assert "allreduce_add_rmsnorm" in result.stdout and "AllReduce, Bias, AddExtraInput, MakeExtraOutput, RMSNorm" \
        in result.stdout


@pytest.mark.dist
def test_dump_shows_collectives_and_fusions():
    result = run_cli("dump", "--sequence-parallel")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "(before fusion)" in out and "(after fusion)" in out
    assert "AllGather" in out and "ReduceScatter" in out
    assert "rule all_gather_linear at" in out and "rule linear_reduce_scatter at" in out


def test_doctor_and_help():
    result = run_cli("doctor")
    assert result.returncode == 0, result.stderr
    assert "rules (in the order tried)" in result.stdout and "allreduce_add_rmsnorm" in result.stdout
    assert run_cli("--help").returncode == 0
    bad = run_cli("frobnicate")
    assert bad.returncode == 2 and "unknown command" in bad.stderr
