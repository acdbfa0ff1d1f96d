"""bench/model.py's timing method on a CPU host: the round-robin order rotates, the A/A control
(a second torch.compile model) reaches the summary, and bench/model_isolated.py combines its
A B B A runs into one ratio per case and refuses flags that would break that."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import model_isolated  # noqa: E402
import model_report  # noqa: E402
from timing import round_order  # noqa: E402


@pytest.mark.parametrize("count", [1, 2, 5, 7])
def test_every_variant_takes_every_position_over_as_many_rounds(count):
    names = [f"v{i}" for i in range(count)]
    rounds = [round_order(names, r) for r in range(count)]
    assert all(sorted(order) == names for order in rounds)  # each round times every variant once
    for position in range(count):
        assert sorted(order[position] for order in rounds) == names
    assert round_order(names, count) == names and round_order([], 3) == []


def _row(case, compile_us, opfuse_us, again_us=None):
    row = {"case": case, "shape": "2048 tok, batch 1", "eager": 30000.0, "compile": compile_us, "opfuse": opfuse_us,
           "compile s": 10.0, "opfuse s": 6.0, "err": {"compile": 1e-2, "opfuse": 1e-2}}
    if again_us is not None:
        row["compile:again"] = again_us
    return row


def test_the_summary_shows_the_a_a_control_and_the_ratio_to_both_compiled_copies():
    opts = {"model": {"dim": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672, "layers": 2}, "device": "cuda"}
    result = {"rows": [_row("train-sp", 18800.0, 19100.0, again_us=19600.0), _row("train-tp", 19000.0, 18700.0)],
              "notes": [], "seconds": 1.0}
    text, summary = model_report.tables("2", result, opts)
    found = {(case, what): (value, met) for _, case, what, value, _, met in summary}
    control, met = found[("train-sp 2048 tok, batch 1", "A/A: compile again / compile")]
    assert control == pytest.approx(19600 / 18800) and met is None  # noise, not a target
    both, _ = found[("train-sp 2048 tok, batch 1", "opfuse / mean of both compile models")]
    assert both == pytest.approx(19100 / 19200)
    assert ("train-tp 2048 tok, batch 1", "A/A: compile again / compile") not in found  # no control, no row
    assert "| compile:again | 19600.0 |" in text  # the control's own row in the variants table


def test_decode_with_the_host_reading_each_token_is_compared_with_compile_read_the_same_way():
    opts = {"model": {"dim": 2048, "heads": 32, "kv_heads": 8, "ffn": 8192, "layers": 16}, "device": "cuda"}
    row = {"case": "decode", "shape": "batch 8", "compile": 1960.0, "opfuse": 1225.0, "compile host-read": 2167.0,
           "opfuse host-read": 1511.0, "err": {}}
    text, summary = model_report.tables("1", {"rows": [row], "notes": [], "seconds": 1.0}, opts)
    found = {(case, what): (value, met) for _, case, what, value, _, met in summary}
    assert found[("decode batch 8", "opfuse / compile, host reading each token")] == (pytest.approx(1511 / 2167), True)
    assert "| decode | batch 8 | opfuse | 1511.0 | 1225.0 | 286.0 | 0.70 |" in text


def test_compile_time_is_also_summed_over_the_run_and_the_first_compile_alternates():
    import model

    opts = {"model": {"dim": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672, "layers": 2}, "device": "cuda"}
    rows = [_row("train-sp", 18800.0, 19100.0), dict(_row("train-tp", 19000.0, 18700.0), **{"opfuse s": 16.0})]
    _, summary = model_report.tables("2", {"rows": rows, "notes": [], "seconds": 1.0}, opts)
    found = {(case, what): (value, met) for _, case, what, value, _, met in summary}
    assert found[("all 2 cases", "opfuse s / compile s (summed)")] == (pytest.approx(22 / 20), False)
    names = ["compile", "opfuse", "compile:again", "opfuse fp8"]
    assert model._first_call_order(names, 0) == names
    assert model._first_call_order(names, 1) == ["opfuse", "compile", "compile:again", "opfuse fp8"]
    assert model._first_call_order(["compile"], 1) == ["compile"]  # --only: nothing to alternate


def test_isolated_runs_combine_into_means_spreads_and_one_ratio():
    def run(variant, us):
        return variant, {"results": {"2": {"rows": [{"case": "train-sp", "shape": "2048 tok, batch 1", variant: us}]}}}

    order = model_isolated.run_order(1)
    assert order == ["compile", "opfuse", "opfuse", "compile"] and model_isolated.run_order(2) == order * 2
    rows = model_isolated.combine([run("compile", 100.0), run("opfuse", 98.0), run("opfuse", 99.0),
                                   run("compile", 102.0)])
    assert len(rows) == 1
    row = rows[0]
    assert row["compile"] == [100.0, 102.0] and row["opfuse"] == [98.0, 99.0]
    assert row["compile mean"] == pytest.approx(101.0) and row["opfuse mean"] == pytest.approx(98.5)
    assert row["compile spread"] == pytest.approx(0.02) and row["ratio"] == pytest.approx(98.5 / 101.0)
    assert "| 2 | train-sp | 2048 tok, batch 1 | 100.0 102.0 | 98.0 99.0 |" in model_isolated.table(rows)
    with pytest.raises(ValueError, match="--rounds 0"):
        model_isolated.run_order(0)


@pytest.mark.parametrize("flag", ["--only", "--variants", "--decode", "--profile"])
def test_isolated_runner_refuses_flags_it_sets_itself(flag):
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "bench/model_isolated.py", "--cpu", flag, "x"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert f"{flag}: not for this script" in run.stderr, run.stderr


def test_isolated_runs_compare_any_pair_of_variants():
    order = model_isolated.run_order(1, ("torchao fp8", "opfuse fp8"))
    assert order == ["torchao fp8", "opfuse fp8", "opfuse fp8", "torchao fp8"]
    runs = [(v, {"results": {"2": {"rows": [{"case": "train-tp", "shape": "2048 tok, batch 1", v: us}]}}})
            for v, us in zip(order, (100.0, 90.0, 92.0, 104.0))]
    (row,) = model_isolated.combine(runs, ("torchao fp8", "opfuse fp8"))
    assert row["ratio"] == pytest.approx(91.0 / 102.0)
    assert "opfuse fp8 / torchao fp8 |" in model_isolated.table([row], ("torchao fp8", "opfuse fp8"))


def test_isolated_runs_of_three_variants_rotate_and_compare_each_to_the_first():
    pair = ("compile", "opfuse fp8", "torchao fp8")
    order = model_isolated.run_order(1, pair)
    assert order == ["compile", "opfuse fp8", "torchao fp8", "torchao fp8", "opfuse fp8", "compile"]
    runs = [(v, {"results": {"2": {"rows": [{"case": "train-tp", "shape": "2048 tok, batch 1", v: us}]}}})
            for v, us in zip(order, (100.0, 80.0, 84.0, 86.0, 82.0, 104.0))]
    (row,) = model_isolated.combine(runs, pair)
    assert row["ratio"] == pytest.approx(81.0 / 102.0) and row["ratio torchao fp8"] == pytest.approx(85.0 / 102.0)
    text = model_isolated.table([row], pair)
    assert "| 100.0 104.0 | 80.0 82.0 | 84.0 86.0 |" in text
    assert text.splitlines()[0].endswith("| opfuse fp8 / compile | torchao fp8 / compile |")


def test_a_variant_under_cuda_graphs_runs_with_the_train_mode_and_keeps_its_own_column(monkeypatch):
    """``VARIANT@graphs``: the same bench/model.py variant, trained under CUDA graphs; it may sit
    beside the variant without graphs, and its runs land in its own column."""
    import types

    commands = []

    def fake_run(command, **kwargs):
        commands.append(command)
        path = command[command.index("--json") + 1]
        variant = command[command.index("--only") + 1]
        graphed = "--train-mode" in command
        with open(path, "w") as handle:
            json.dump({"results": {"2": {"rows": [{"case": "train-sp", "shape": "2048 tok, batch 1",
                                                   variant: 80.0 if graphed else 100.0}]}}}, handle)
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(model_isolated.subprocess, "run", fake_run)
    pair = ("opfuse fp8", "opfuse fp8@graphs")
    data = model_isolated.measure(types.SimpleNamespace(rounds=1, pair=pair, run_timeout=7.0), ["--fp8", "row"])
    assert [c[c.index("--only") + 1] for c in commands] == ["opfuse fp8"] * 4
    assert [c[-2:] == ["--train-mode", "reduce-overhead"] for c in commands] == [False, True, True, False]
    (row,) = data["rows"]
    assert row["opfuse fp8"] == [100.0, 100.0] and row["opfuse fp8@graphs"] == [80.0, 80.0]
    assert row["ratio"] == pytest.approx(0.8)
    assert model_isolated.variant_of("compile@graphs") == "compile" and model_isolated.variant_of("opfuse") == "opfuse"


def test_a_variant_with_a_forced_implementation_runs_with_it_and_keeps_its_own_column(monkeypatch):
    """``VARIANT%OP=IMPL``: the same bench/model.py variant with ``OPFUSE_FORCE_IMPL=OP=IMPL`` in its
    process's environment (and only there), under CUDA graphs when the entry says so."""
    import types

    calls = []

    def fake_run(command, env=None, **kwargs):
        calls.append((command, env.get("OPFUSE_FORCE_IMPL")))
        path = command[command.index("--json") + 1]
        forced = env.get("OPFUSE_FORCE_IMPL") is not None
        with open(path, "w") as handle:
            json.dump({"results": {"2": {"rows": [{"case": "train-sp", "shape": "2048 tok, batch 1",
                                                   "opfuse fp8": 90.0 if forced else 100.0}]}}}, handle)
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(model_isolated.subprocess, "run", fake_run)
    monkeypatch.delenv("OPFUSE_FORCE_IMPL", raising=False)
    forced = "opfuse fp8@graphs%linear_reduce_scatter_fp8=p2p_overlap"
    pair = ("opfuse fp8@graphs", forced)
    data = model_isolated.measure(types.SimpleNamespace(rounds=1, pair=pair, run_timeout=7.0), ["--fp8", "row"])
    assert [env for _, env in calls] == [None, "linear_reduce_scatter_fp8=p2p_overlap",
                                         "linear_reduce_scatter_fp8=p2p_overlap", None]
    assert all(c[c.index("--only") + 1] == "opfuse fp8" and c[-2:] == ["--train-mode", "reduce-overhead"]
               for c, _ in calls)
    (row,) = data["rows"]
    assert row[forced] == [90.0, 90.0] and row["ratio"] == pytest.approx(0.9)
    assert model_isolated.variant_of(forced) == "opfuse fp8" and model_isolated.forced_impl("opfuse") is None
    assert model_isolated.entry_environment("opfuse%ALLREDUCE_CHUNKS=1") == {"OPFUSE_ALLREDUCE_CHUNKS": "1"}
    assert model_isolated.entry_environment("opfuse") == {}


@pytest.mark.parametrize("args, message", [
    (["--pair", "opfuse", "opfuse"], "two different variants"),
    (["--pair", "compile", "opfuse fp8"], "the fp8 variants need --fp8"),
    (["--pair", "compile", "opfuse@cudagraphs"], "optionally with '@graphs'"),
    (["--pair", "compile", "opfuse%"], "OPFUSE_FORCE_IMPL=OP=IMPL"),
    (["--pair", "compile", "opfuse@graphs", "--train-mode", "default"], "--train-mode: not for this script"),
])
def test_isolated_runner_refuses_a_pair_it_cannot_compare(args, message):
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "bench/model_isolated.py", "--cpu", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_isolated_runner_records_a_run_past_its_time_limit_and_goes_on(monkeypatch):
    """A run still compiling at --run-timeout is a failed run of the table, not a crash that loses the
    runs already done; each finished run's time is printed as it ends."""
    import types

    calls = []

    def fake_run(command, **kwargs):
        calls.append(command[command.index("--only") + 1])
        if len(calls) == 1:
            raise subprocess.TimeoutExpired(command, kwargs["timeout"])
        path = command[command.index("--json") + 1]
        variant = calls[-1]
        with open(path, "w") as handle:
            json.dump({"results": {"2": {"rows": [{"case": "train-sp", "shape": "2048 tok, batch 4",
                                                   variant: 100.0 + len(calls)}]}}}, handle)
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(model_isolated.subprocess, "run", fake_run)
    args = types.SimpleNamespace(rounds=1, pair=("compile", "opfuse"), run_timeout=7.0)
    data = model_isolated.measure(args, [])
    assert calls == ["compile", "opfuse", "opfuse", "compile"]
    assert data["failed"] == ["run 1 (compile): still running after --run-timeout 7.0 s"]
    (row,) = data["rows"]
    assert row["compile"] == [104.0] and row["opfuse"] == [102.0, 103.0]
    assert model_isolated.run_times({"results": {"2": {"rows": [{"case": "train-sp", "shape": "s", "opfuse": 5.0}]}}},
                                    "opfuse") == "train-sp s: 5.0 us"
    # --warmup-run: one more run first (the order's last variant), left out of the table
    calls.clear()
    args.warmup_run = True
    data = model_isolated.measure(args, [])
    assert calls == ["compile", "compile", "opfuse", "opfuse", "compile"] and data["warm-up runs"] == ["compile"]
    assert data["failed"] == ["warm-up run (compile): still running after --run-timeout 7.0 s"]
    (row,) = data["rows"]
    assert row["compile"] == [102.0, 105.0] and row["opfuse"] == [103.0, 104.0]


def test_every_extra_variant_of_the_bench_has_a_column_in_its_report():
    import model

    assert set(model.EXTRA_VARIANTS) <= set(model_report.EXTRA_COLUMNS)


def test_gpu_clocks_summary_takes_each_variants_samples_inside_its_spans():
    """bench/gpu_clocks.py: a sample counts for the variant whose span holds its time (both ends
    included), spans of one name pool their samples, and a name with no sample is left out."""
    import gpu_clocks

    samples = [(0.5, 1980.0, 300.0), (1.0, 1700.0, 690.0), (1.5, 1600.0, 700.0), (2.5, 1500.0, 699.0),
               (3.0, 1900.0, 400.0), (9.0, 1000.0, 100.0)]
    spans = [("compile", 1.0, 1.5), ("opfuse", 2.0, 3.0), ("compile", 2.4, 2.6), ("eager", 4.0, 5.0)]
    got = gpu_clocks.summary(samples, spans)
    assert got == {"compile": (1600.0, 699.0, 3), "opfuse": (1700.0, 549.5, 2)}


def test_gpu_clocks_sampler_is_none_without_a_gpu():
    import gpu_clocks

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the sampler may open")
    assert gpu_clocks.Sampler.for_current_device() is None


def test_gpu_clocks_sampler_reads_clock_and_power_on_its_thread_and_stops():
    """The sampling thread with a stand-in for NVML: readings converted (mW -> W), a refused reading
    skipped, nothing sampled after stop()."""
    import time

    import gpu_clocks

    class FakeNvml:
        calls = 0

        def nvmlDeviceGetClockInfo(self, handle, kind, out):
            FakeNvml.calls += 1
            out._obj.value = 1755
            return 0 if FakeNvml.calls % 3 else 999  # every third reading refused

        def nvmlDeviceGetPowerUsage(self, handle, out):
            out._obj.value = 688500
            return 0

    sampler = gpu_clocks.Sampler(FakeNvml(), None, interval=0.001)
    assert sampler.read() == (1755.0, 688.5)
    sampler.start()
    time.sleep(0.05)
    sampler.stop()
    count = len(sampler.samples)
    assert count >= 3 and all(s[1:] == (1755.0, 688.5) for s in sampler.samples)
    assert FakeNvml.calls > count  # the refused readings left no sample
    time.sleep(0.01)
    assert len(sampler.samples) == count
