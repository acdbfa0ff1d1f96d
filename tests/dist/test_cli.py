"""The commands' entry points: ``python -m opfuse demo`` and ``dump`` (2 gloo processes),
under torchrun too; their output files, ``--version``, one-line errors, and ``bench``.

The quick commands (``--version``, ``--help``, argument errors, ``bench`` on a host without GPUs)
all run from one interpreter start (tests/dist/opfuse_commands.py: each forked after the import
that ``python -m opfuse`` begins with, its output and exit status its own); the others each in
their own ``python -m opfuse``, the demo and dump ones two at a time."""

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")


def env():
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "opfuse", *args], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=timeout)


def gpu_benchmarks() -> list[tuple[str, int]]:
    """bench/common.py's benchmarks that need GPUs: ``(name, GPUs)``."""
    sys.path.insert(0, BENCH)
    try:
        from common import BENCHMARKS
    finally:
        sys.path.remove(BENCH)
    return [(name, gpus) for name, (gpus, _) in BENCHMARKS.items() if gpus]


#: The commands the tests below run through :func:`quick_cli`.
QUICK_COMMANDS = [("--version",), ("--help",), ("frobnicate",), ("dump", "--world", "0"), ("dump", "--format", "svg"),
                  ("demo", "--world", "4", "--hidden", "30"), ("demo", "--backend", "nccl"), ("bench",),
                  ("bench", "timing")] + [("bench", name) for name, _ in gpu_benchmarks()]


@pytest.fixture(scope="module")
def quick_cli(tmp_path_factory):
    """``quick_cli(*args)``: what ``python -m opfuse ARGS`` returned (a ``CompletedProcess``), for
    every command of :data:`QUICK_COMMANDS` from one run of tests/dist/opfuse_commands.py; any other
    command in its own interpreter (:func:`run_cli`)."""
    folder = tmp_path_factory.mktemp("opfuse_commands")
    requests, results = folder / "requests.json", folder / "results.json"
    requests.write_text(json.dumps([list(command) for command in QUICK_COMMANDS]))
    runner = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "dist", "opfuse_commands.py"), str(requests),
                             str(results), str(folder)], cwd=ROOT, env=env(), capture_output=True, text=True,
                            timeout=600)
    assert runner.returncode == 0, f"tests/dist/opfuse_commands.py failed:\n{runner.stdout}\n{runner.stderr}"
    found = {command: subprocess.CompletedProcess([sys.executable, "-m", "opfuse", *command], result["returncode"],
                                                  result["stdout"], result["stderr"])
             for command, result in zip(QUICK_COMMANDS, json.loads(results.read_text()), strict=True)}
    return lambda *args: found[args] if args in found else run_cli(*args)


@pytest.fixture(scope="module")
def started_cli(tmp_path_factory):
    """The demo and dump commands below (each spawns its ranks), started two at a time when a test
    first asks: ``started_cli(*args)`` waits for one's result (each in its own ``python -m opfuse``,
    :func:`run_cli`); ``started_cli.html`` is the file ``dump --format html -o`` writes."""
    html = tmp_path_factory.mktemp("dump") / "demo.html"
    commands = [("demo", "--world", "2"), ("dump", "--sequence-parallel"), ("dump", "--format", "html"),
                ("dump", "--format", "dot"), ("dump", "--format", "html", "-o", str(html))]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        started = {command: pool.submit(run_cli, *command) for command in commands}

        def result(*args):
            return started[args].result() if args in started else run_cli(*args)

        result.html = html
        yield result


def one_line_error(result, code=2):
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.dist
def test_demo_reports_check_passed(started_cli):
    result = started_cli("demo", "--world", "2")
    assert result.returncode == 0, result.stderr
    assert "result: check PASSED" in result.stdout
    assert "allreduce_add_rmsnorm" in result.stdout and "AllReduce, Bias, AddExtraInput, MakeExtraOutput, RMSNorm" \
        in result.stdout


#: What torch's gloo teardown sometimes prints when a rank's interpreter exits while a gloo worker
#: thread is still being destroyed (after the script finished and destroyed its process groups):
#: pytorch/pytorch#179291 describes the race. Not opfuse's; a run that hit it is run once more.
_GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def _torchrun_run(command: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=180)
    if result.returncode != 0 and _GLOO_TEARDOWN_ABORT in result.stdout + result.stderr:
        result = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=180)
    return result


def torchrun() -> list[str]:
    """The torchrun command (it ships with torch; the module form works where the script is not
    on PATH); skips the test when neither runs."""
    script = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    command = [script] if script else [sys.executable, "-m", "torch.distributed.run"]
    probe = subprocess.run(command + ["--help"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"torchrun is not usable here: {probe.stderr.strip()[-200:]}")
    return command


@pytest.mark.dist
def test_demo_under_torchrun():
    command = torchrun()
    result = _torchrun_run(command + ["--standalone", "--nproc-per-node", "2", "-m", "opfuse", "demo"])
    assert result.returncode == 0, result.stdout + result.stderr
    # The two torchrun processes are the group (world 2), nobody spawns more, rank 0 reports once.
    assert result.stdout.count("result: check PASSED") == 1, result.stdout
    assert "world=2 (gloo, cpu)" in result.stdout
    three = ["--standalone", "--nproc-per-node", "2", "-m", "opfuse", "demo", "--world", "3"]
    mismatch = subprocess.run(command + three, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=180)
    assert mismatch.returncode != 0 and "torchrun started 2 processes" in mismatch.stderr


@pytest.mark.dist
def test_porting_example_under_torchrun():
    """examples/port_mlp.py: a plain gated MLP ported to ops.Sequential, trained one step, and its
    weights gathered back into the plain model (docs/guide.md, "Porting a model")."""
    result = _torchrun_run(torchrun() + ["--standalone", "--nproc-per-node", "2", "examples/port_mlp.py"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "port_mlp: world=2 (cpu)" in result.stdout and "port_mlp: PASSED" in result.stdout


@pytest.mark.dist
def test_dump_shows_collectives_and_fusions(started_cli):
    result = started_cli("dump", "--sequence-parallel")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "(before fusion)" in out and "(after fusion)" in out
    assert "AllGather" in out and "ReduceScatter" in out
    assert "rule all_gather_linear at" in out and "rule linear_reduce_scatter at" in out


@pytest.mark.dist
def test_dump_html_and_dot_are_clean_documents(started_cli):
    page = started_cli("dump", "--format", "html")
    assert page.returncode == 0, page.stderr
    assert page.stdout.startswith("<!doctype html>") and page.stdout.endswith("</html>\n")
    assert "fusions:" in page.stderr  # the explain text goes to stderr, not into the page
    dot = started_cli("dump", "--format", "dot")
    assert dot.returncode == 0, dot.stderr
    assert dot.stdout.startswith("digraph opfuse {") and dot.stdout.endswith("}\n")
    assert "output ?" not in dot.stdout and "\\n?" not in dot.stdout
    if shutil.which("dot"):
        svg = subprocess.run(["dot", "-Tsvg"], input=dot.stdout, capture_output=True, text=True, timeout=60)
        assert svg.returncode == 0 and "<svg" in svg.stdout, svg.stderr
    target = started_cli.html
    written = started_cli("dump", "--format", "html", "-o", str(target))
    assert written.returncode == 0 and written.stdout == "", written.stdout[:200]
    assert target.read_text() == page.stdout and f"wrote {target}" in written.stderr


def test_version_help_and_one_line_errors(quick_cli):
    import opfuse

    version = quick_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith(f"opfuse {opfuse.__version__} (torch ")
    assert quick_cli("--help").returncode == 0
    assert "unknown command 'frobnicate'" in one_line_error(quick_cli("frobnicate"))
    assert "--world: 0 is not a positive integer" in one_line_error(quick_cli("dump", "--world", "0"))
    assert "--format: invalid choice: 'svg'" in one_line_error(quick_cli("dump", "--format", "svg"))
    assert "--hidden=30 must be divisible by --world=4" in one_line_error(
        quick_cli("demo", "--world", "4", "--hidden", "30"))
    assert "needs 2 GPUs" in one_line_error(quick_cli("demo", "--backend", "nccl"))


def test_doctor():
    result = run_cli("doctor")
    assert result.returncode == 0, result.stderr
    assert "rules (in the order tried)" in result.stdout and "allreduce_add_rmsnorm" in result.stdout
    assert "Failed to initialize NumPy" not in result.stderr  # numpy is a declared dependency


def test_bench_lists_only_benchmarks_and_skips_without_gpus(quick_cli):
    sys.path.insert(0, BENCH)
    try:
        from common import BENCHMARKS
    finally:
        sys.path.remove(BENCH)
    listing = quick_cli("bench")
    assert listing.returncode == 0
    listed = [line.split()[0] for line in listing.stdout.splitlines()[1:]]
    assert listed == list(BENCHMARKS) and "timing" not in listed and "common" not in listed
    assert "unknown benchmark 'timing'" in one_line_error(quick_cli("bench", "timing"))
    gpu_benches = [(name, gpus) for name, (gpus, _) in BENCHMARKS.items() if gpus]
    results = [quick_cli("bench", name) for name, _ in gpu_benches]
    for (name, gpus), result in zip(gpu_benches, results):
        assert result.returncode == 0, (name, result.stderr)
        assert result.stdout.strip() == f"no GPU: {name} needs {gpus} CUDA GPU{'s' if gpus > 1 else ''}; skipped"
        assert "Traceback" not in result.stderr
