"""The benchmarks' common behaviour on a CPU host: --json, --plot (matplotlib optional, one line
without it), --from-json (tables and chart from recorded numbers), progress on stderr; and the
docs/performance.md chart's data (docs/measurements/allreduce_v3_w2w4.json) matches the recorded table."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDED = os.path.join(ROOT, "docs", "measurements", "allreduce_v3_w2w4.json")


def bench(*args, extra_path=None, timeout=300):
    path = os.pathsep.join(p for p in (extra_path, ROOT) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_host_overhead_json_plot_and_from_json(tmp_path):
    data, chart = tmp_path / "run.json", tmp_path / "run.png"
    run = bench("bench/host_overhead.py", "--calls", "20", "--json", str(data), "--plot", str(chart))
    assert run.returncode == 0, run.stderr
    assert "unfused program done" in run.stderr  # progress goes to stderr, tables to stdout
    saved = json.loads(data.read_text())
    assert saved["device"] == "cpu" and [r["path"] for r in saved["rows"]] == ["unfused program", "fused program"]
    assert chart.exists() == has_matplotlib()
    again = bench("bench/host_overhead.py", "--from-json", str(data))
    assert again.returncode == 0, again.stderr
    assert again.stdout == run.stdout  # the same tables from the saved numbers


def test_compiled_dispatch_times_both_ways_of_calling_the_fused_ops():
    run = bench("bench/compiled_dispatch.py", "--calls", "5", "--rounds", "1")
    assert run.returncode == 0, run.stderr
    assert "| direct overload |" in run.stdout and "| saved by direct |" in run.stdout, run.stdout
    assert "allreduce_add_rmsnorm=reference" in run.stdout


def test_plot_without_matplotlib_is_one_line(tmp_path):
    blocker = tmp_path / "block" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib blocked for this test')\n")
    chart = tmp_path / "chart.png"
    run = bench("bench/allreduce_norm.py", "--from-json", RECORDED, "--plot", str(chart),
                extra_path=str(tmp_path / "block"))
    assert run.returncode == 0 and not chart.exists()
    assert run.stderr.strip().splitlines() == [
        "--plot needs matplotlib (pip install matplotlib, or pip install 'opfuse[plot]'); no chart drawn"]


def test_recorded_allreduce_chart_matches_the_published_table(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import allreduce_norm
        from allreduce_table_to_json import parse
    finally:
        del sys.path[:2]
    with open(os.path.join(ROOT, "docs", "measurements", "allreduce_v3_w2w4.txt")) as handle:
        parsed = parse(handle.read())
    with open(RECORDED) as handle:
        recorded = json.load(handle)
    assert parsed == recorded  # the JSON is the table, nothing added
    series = allreduce_norm.ratio_series(recorded)
    w2 = dict(series["world 2, hidden 8192: opfuse / NCCL+compiled"])
    w4 = dict(series["world 4, hidden 8192: opfuse / NCCL+compiled"])
    # docs/performance.md's table: opfuse / compiled 0.61, 0.45, 0.87 at world 2; 0.51, 0.79, 0.88 at world 4.
    assert [round(w2[t], 2) for t in (1, 128, 8192)] == [0.61, 0.45, 0.87]
    assert [round(w4[t], 2) for t in (1, 512, 8192)] == [0.51, 0.79, 0.88]
    if not has_matplotlib():
        pytest.skip("matplotlib not installed: the chart itself is not drawn")
    chart = tmp_path / "allreduce.png"
    run = bench("bench/allreduce_norm.py", "--from-json", RECORDED, "--plot", str(chart))
    assert run.returncode == 0, run.stderr
    assert "| 8192 | 131072 KiB | 477.8 | 663.2 | 643.0 |" in run.stdout
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.dist
def test_block_cpu_dry_run_spawns_ranks_and_reports(tmp_path):
    """bench/block.py --cpu: two gloo ranks through common.run_ranks, progress per case, --json
    and --plot, and --from-json printing the same tables again."""
    data, chart = tmp_path / "block.json", tmp_path / "block.png"
    run = bench("bench/block.py", "--world", "2", "--cpu", "--skip", "compile", "--json", str(data), "--plot", str(chart))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "world 2 decode T=1: done" in run.stderr and "world 2 train-sp T=8: done" in run.stderr
    saved = json.loads(data.read_text())
    assert [r["case"] for r in saved["results"]["2"]["rows"]] == ["decode", "decode", "train-tp", "train-sp"]
    assert chart.exists() == has_matplotlib()
    again = bench("bench/block.py", "--from-json", str(data))
    assert again.returncode == 0, again.stderr
    table = [line for line in run.stdout.splitlines() if line.startswith("| 4 |")]  # decode, 4 tokens
    assert table and all(line in again.stdout for line in table)


def test_allreduce_quick_rows_print_bandwidth_and_issue_30_targets(tmp_path):
    """A ``--quick`` run's rows (no compiled / eager / symm / plain columns, a column that failed)
    print without those columns, with GB/s per direction and issue 30's summary last."""
    rows = []
    for tokens in (1, 1024, 8192):
        message = tokens * 8192 * 2
        rows.append({"hidden": 8192, "tokens": tokens, "bytes": message, "err": {"ours_y": 2e-3}, "quick": True,
                     "floor": None, "nccl_ar": 10 + message / 260e3, "ours": 5 + message / 350e3,
                     "ours_impl": "cuda_oneshot" if tokens == 1 else "cuda_twoshot_lamport",
                     "ours_1shot": None, "ours_1shot_why": "ImplementationError: over the cap",
                     "ours_2shotL": 6 + message / 350e3, "ours_2shot": 12 + message / 210e3, "ours_nccl": None,
                     "fi": None, "fi_why": "no FlashInfer headers"})
    data = tmp_path / "quick.json"
    data.write_text(json.dumps({"2": {"rows": rows, "quick": True, "flashinfer": "no FlashInfer headers",
                                      "ceilings": {"peer_egress_gbs": {"nccl": 330.0, "copy_engine": 370.0,
                                                                       "best": 370.0}, "hbm_copy_gbs": 2900.0}}}))
    run = bench("bench/allreduce_norm.py", "--from-json", str(data))
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "NCCL+compiled" not in out.split("summary")[0] and "| ours 2shotL |" in out
    assert "GB/s ours" in out and "peer copy GB/s" in out
    assert "not measured (tokens column: why): 1 ours_1shot: ImplementationError: over the cap" in out
    summary = out[out.index("\nsummary"):]
    # 8192 tokens: 134217728 B / (5 + 134217728 / 350e3) us = ~345 GB/s per direction at W = 2
    last = [line for line in summary.splitlines() if line.startswith("| 2 | 8192 | 8192 |")][0]
    assert "| 345 |" in last and "| 370 |" in last and last.endswith("| yes |")
    assert summary.strip().splitlines()[-1] == "targets met at 2 of 3 sizes"  # 1 token: 5.1 us > 4.5


def test_moe_cpu_dry_run_takes_the_target_against_the_faster_compile_variant(tmp_path):
    data = tmp_path / "moe.json"
    run = bench("bench/moe.py", "--cpu", "--json", str(data))
    assert run.returncode == 0, run.stderr
    row = json.loads(data.read_text())["rows"][0]
    best = min(row["compile"], row["compile dynamic"])
    assert "| opfuse / best compile |" in run.stdout
    assert f"| T=64 | opfuse / best compile | {row['opfuse'] / best:.2f} |" in run.stdout, run.stdout


def test_moe_cpu_dry_run_times_the_fp8_variants_side_by_side(tmp_path):
    data = tmp_path / "moe.json"
    run = bench("bench/moe.py", "--cpu", "--fp8", "--fp8-wgrad-ab", "--fp8-pow2", "--only", "opfuse fp8",
                "opfuse fp8 hp-wgrad", "opfuse fp8 pow2", "--json", str(data))
    assert run.returncode == 0, run.stderr
    row = json.loads(data.read_text())["rows"][0]
    assert row["opfuse fp8"] > 0 and row["opfuse fp8 hp-wgrad"] > 0 and row["opfuse fp8 pow2"] > 0
    assert "| tokens | eager | opfuse fp8 hp-wgrad | opfuse fp8 | opfuse fp8 pow2 |" in run.stdout
    assert "| opfuse fp8 pow2 / best compile |" in run.stdout
    for flag in ("--fp8-wgrad-ab", "--fp8-pow2"):
        refused = bench("bench/moe.py", "--cpu", flag)
        assert refused.returncode != 0 and f"{flag} needs --fp8" in refused.stderr


def test_every_peer_kernel_of_opfuse_has_its_kernel_table_category():
    """The Lamport two-shot was counted under "other" in the model profiles (session 9)."""
    sys.path.insert(0, ROOT)
    from bench.kernel_table import category_of

    for kernel in ("void opfuse::(anonymous namespace)::lamport_kernel<__nv_bfloat16, 1, (opfuse::QuantMode)0>(...)",
                   "void opfuse::(anonymous namespace)::oneshot_kernel<float, 2, (opfuse::QuantMode)1>(...)",
                   "void opfuse::(anonymous namespace)::twoshot_kernel<__half, 1, (opfuse::QuantMode)0>(...)"):
        assert category_of(kernel) == "opfuse all-reduce+norm", kernel


def test_step_timeline_says_what_ran_beside_each_collective():
    """The per-collective view that found session 17's missing overlap: for each NCCL kernel of the
    last step, the time kernels of other streams ran beside it and the kernel it started after."""
    sys.path.insert(0, ROOT)
    from bench import step_timeline

    class Event:  # the parts of a profiler event the timeline reads
        def __init__(self, name, start, end, stream):
            self._name, self._start, self._end, self._stream = name, start, end, stream

        def name(self):
            return self._name

        def start_ns(self):
            return self._start

        def end_ns(self):
            return self._end

        def device_resource_id(self):
            return self._stream

    step = [("dx_gemm", 0, 5000, 7), ("ncclDevKernel_ReduceScatter", 5500, 9000, 20), ("dw_gemm", 6000, 8000, 7),
            ("ncclDevKernel_AllGather", 9500, 11000, 20)]  # the gather: nothing beside it
    events = [Event(n, a + k * 12000, b + k * 12000, s) for k in range(2) for n, a, b, s in step]
    rows = step_timeline._collectives(events, 12000)
    assert [r["name"] for r in rows] == ["ncclDevKernel_ReduceScatter", "ncclDevKernel_AllGather"]
    scatter, gather = rows
    assert scatter["beside_us"] == 2.0 and scatter["beside"] == [("dw_gemm", 2000)]
    # the last step: the step length back from the last kernel's end (23 us - 12 us = 11 us on)
    assert scatter["after"] == "dx_gemm" and scatter["after_gap_us"] == 0.5 and scatter["at_us"] == 17.5 - 11.0
    assert gather["beside_us"] == 0.0 and gather["after"] == "dw_gemm"
    text = step_timeline.format_timeline({"v": {"host_us": 0, "gpu_wall_us": 0, "busy_us": 0, "idle": {}, "gaps": [],
                                                "collectives": rows}}, "t")
    assert "NCCL kernels of the last step" in text and "dw_gemm 2" in text


def test_allreduce_timeline_phases_from_stamps(tmp_path):
    """bench/allreduce_timeline.py's analysis of the one-shot's stamps: phases relative to each
    call's first block entry, earliest..latest block, row phases only where written, the first call
    of a replay left out, medians over the others (one slow call is an outlier, not a shift), and
    the period and gap to the next call; --from-json prints the table."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import allreduce_timeline as timeline
    finally:
        sys.path.pop(0)
    stamps = torch.zeros(64, 512, 8, dtype=torch.int64)
    starts = {0: 10_000, 1: 20_000, 2: 30_003, 3: 40_003}
    for ring, call in ((5, 2), (6, 0), (7, 1), (9, 3)):  # ring slots need not be in call order
        base = starts[call]
        for block in range(2):
            row = [base + 100 * block, base + 300, base + 500 + block, 0, 0, base + 4000 + 500 * block]
            if block == 0:
                row[3:5] = [base + 2000, base + (3000 if call != 2 else 9000)]
            stamps[ring, block, :6] = torch.tensor(row)
    phases = timeline.phase_table(stamps)
    assert phases["state"] == pytest.approx((0.3, 0.3))
    assert phases["pushed"] == pytest.approx((0.5, 0.501))
    assert phases["arrived"] == pytest.approx((2.0, 2.0))
    assert phases["row"] == pytest.approx((3.0, 3.0))  # the median of 3.0, 9.0, 3.0
    assert phases["end"] == pytest.approx((4.0, 4.5))
    assert phases["next"][0] == pytest.approx(10.0)  # the median of 10.0, 10.003, 10.0
    assert phases["gap"][0] == pytest.approx(10.0 - 4.5)
    rows = [{"hidden": 8192, "tokens": 1, "pdl": False, "rank": r, "us": 5.0, "stamped_us": 5.1,
             "phases": phases} for r in (0, 1)]
    saved = tmp_path / "timeline.json"
    saved.write_text(json.dumps(rows))
    run = bench("bench/allreduce_timeline.py", "--from-json", str(saved))
    assert run.returncode == 0, run.stderr
    assert "one-shot phase timeline" in run.stdout and " 4.00..4.50" in run.stdout


def test_allreduce_simulated_skips_without_a_gpu_and_prints_recorded_rows(tmp_path):
    run = bench("bench/allreduce_simulated.py")
    assert run.returncode == 0, run.stderr
    assert "skipped" in run.stdout
    saved = tmp_path / "sim.json"
    saved.write_text(json.dumps([{"kind": "oneshot", "hidden": 8192, "tokens": 1, "us": 4.56, "pdl": False,
                                  "label": "new"}]))
    again = bench("bench/allreduce_simulated.py", "--from-json", str(saved))
    assert again.returncode == 0, again.stderr
    assert "build new, PDL off" in again.stdout and "| oneshot | 8192 | 1 | 4.56 |" in again.stdout


def test_crossover_report_judges_the_choice_not_the_sweeps_noise(tmp_path):
    """bench/allreduce_crossover.py: a size misses only when the chosen implementation's forced time
    is more than the tolerance above the fastest forced one; an automatic run of the fastest
    implementation that timed slower is counted as noise, apart."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import allreduce_crossover as sweep
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))

    def row(tokens, times, auto_impl, auto_us):
        return {"world": 2, "hidden": 8192, "tokens": tokens, "bytes": tokens * 16384, "times": times,
                "auto_impl": auto_impl, "auto_us": auto_us}

    rows = [row(1, {"cuda_oneshot": 4.0, "cuda_twoshot_lamport": 7.0}, "cuda_oneshot", 6.0),  # noise only
            row(512, {"cuda_oneshot": 16.0, "cuda_twoshot_lamport": 17.0}, "cuda_twoshot_lamport", 17.0),  # a miss
            row(4096, {"cuda_oneshot": 300.0, "cuda_twoshot_lamport": 200.0}, "cuda_twoshot_lamport", 201.0)]
    _, misses = sweep.report(rows, 0.03)
    assert [(r["tokens"], best, round(ratio, 4)) for r, best, ratio in misses] == [(512, "cuda_oneshot", 1.0625)]
    assert sweep.noisy_runs(rows, 0.03) == 1
    # the recorded H200 sweep (session 28) through --from-json: every choice within 3%, noise apart
    recorded = os.path.join(ROOT, "docs", "measurements", "allreduce_crossover_s28_h200x2.json")
    run = bench("bench/allreduce_crossover.py", "--from-json", recorded)
    assert run.returncode == 0, run.stderr
    assert "within 3% of the fastest forced implementation at 45 of 45 sizes" in run.stdout
    assert "noise: 12 sizes" in run.stdout
