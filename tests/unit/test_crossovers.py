"""The all-reduce + norm dispatch crossovers: the packaged table, its lookup rules (world fallback,
log-log interpolation in row size, nearest point where a limit is absent), the settings that
override it, and the fit of tools/crossover_table.py that writes it from a sweep."""

import importlib.util
import json
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import opfuse
from opfuse.families.residual_norm import crossovers
from opfuse.families.residual_norm.crossovers import CrossoverTable, Limits
from opfuse.machinery.implementation import CallSpec
from opfuse.ops.base import TensorMeta

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("crossover_table", os.path.join(ROOT, "tools", "crossover_table.py"))
crossover_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(crossover_table)

MiB = 1 << 20
ONE, TWO, NCCL, LAMPORT = "cuda_oneshot", "cuda_twoshot", "nccl+cuda", "cuda_twoshot_lamport"


def make(worlds):
    return CrossoverTable.from_dict({"worlds": {str(w): points for w, points in worlds.items()}}, source="test")


def point(row, one, two, lamport=None, with_lamport=False):
    entry = {"row_bytes": row, "oneshot_max": one, "twoshot_max": two}
    if with_lamport:
        entry["lamport_max"] = lamport
    return entry


# The packaged table --------------------------------------------------------------------------------


def test_packaged_table_holds_the_session_8_sweep():
    table = crossovers.table()
    assert sorted(table.worlds) == [2, 3, 4, 8]
    # worlds 2 and 4: tools/crossover_table.py on the 4x H200 sweep of session 8 (rows 4-32 KiB): the
    # one-shot up to a few MiB, the pipelined Lamport two-shot above it without limit (it won every
    # larger measured size); docs/PERF_NOTES.md, "Issue 30 ... session 8"
    for world, row, oneshot in ((2, 8192, 2965820), (2, 10240, 3707276), (2, 16384, 5931641), (4, 16384, 2 * MiB),
                                (4, 8192, 1 * MiB)):
        assert table.limits(world, row) == Limits(oneshot, None, None), (world, row)
    # worlds 3 and 8 were not in the sweep: their limits from before it (no Lamport there)
    assert table.limits(3, 8192) == Limits(2 * MiB, 16 * MiB, 0)
    assert table.limits(8, 16384).lamport_max == 0
    assert table.limits(2, 2048).oneshot_max == table.limits(2, 4096).oneshot_max  # shorter rows: the 4 KiB point
    # unlisted worlds take the next larger listed one (the old default for worlds 5-7 and 9+: 512 KiB)
    for world in (5, 6, 7, 16):
        assert table.limits(world, 16384).oneshot_max == 512 << 10


def test_backend_limits_come_from_the_table_unless_a_setting_overrides_them():
    from opfuse.families.residual_norm import cuda

    assert cuda.oneshot_limit(2, 16384) == crossovers.table().limits(2, 16384).oneshot_max
    assert cuda.twoshot_limit(4, 8192) == crossovers.table().limits(4, 8192).twoshot_max
    with opfuse.config.override(oneshot_max_bytes=12345, twoshot_max_bytes=67890):
        assert cuda.oneshot_limit(2, 16384) == 12345
        assert cuda.twoshot_limit(2, 16384) == 67890


# Lookup rules ----------------------------------------------------------------------------------------


def test_world_without_points_uses_the_next_larger_listed_world_else_the_largest():
    table = make({2: [point(1024, 10, 100)], 4: [point(1024, 20, 200)], 8: [point(1024, 30, 300)]})
    assert [table.world_for(w) for w in (2, 3, 4, 5, 8, 9, 64)] == [2, 4, 4, 8, 8, 8, 8]
    assert table.limits(3, 1024) == Limits(20, 200)


def test_rows_outside_the_points_take_the_nearest_point():
    table = make({2: [point(4096, 10, 100), point(16384, 40, 400)]})
    assert table.limits(2, 0) == Limits(10, 100)
    assert table.limits(2, 1024) == Limits(10, 100)
    assert table.limits(2, 16384) == Limits(40, 400)
    assert table.limits(2, 1 << 20) == Limits(40, 400)


def test_rows_between_points_interpolate_log_log():
    table = make({2: [point(4096, 1 * MiB, 16 * MiB), point(16384, 4 * MiB, 256 * MiB)]})
    mid = table.limits(2, 8192)  # halfway in log(row bytes)
    assert mid == Limits(2 * MiB, 64 * MiB)
    quarter = table.limits(2, int(4096 * 2 ** 0.5))
    assert quarter.oneshot_max == pytest.approx(MiB * 2 ** 0.5, rel=1e-3)  # the row is rounded down to bytes
    assert quarter.twoshot_max == pytest.approx(16 * MiB * 2, rel=1e-3)


def test_absent_limits_are_not_interpolated_the_nearer_point_wins():
    table = make({2: [point(4096, 0, None), point(16384, 4 * MiB, 256 * MiB)]})
    assert table.limits(2, 6000) == Limits(0, None)            # nearer the 4 KiB point
    assert table.limits(2, 8192) == Limits(0, None)            # exactly halfway: the smaller row
    assert table.limits(2, 12000) == Limits(4 * MiB, 256 * MiB)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 20), st.integers(1, 20), st.integers(4096, 65536))
def test_interpolated_limits_lie_between_their_points(a, b, row):
    table = make({2: [point(4096, a * MiB, a * 2 * MiB), point(65536, b * MiB, b * 2 * MiB)]})
    got = table.limits(2, row)
    assert min(a, b) * MiB - 1 <= got.oneshot_max <= max(a, b) * MiB + 1
    assert min(a, b) * 2 * MiB - 1 <= got.twoshot_max <= max(a, b) * 2 * MiB + 1


@pytest.mark.parametrize("bad, message", [
    ({"worlds": {}}, "no world sizes"),
    ({"worlds": {"two": [point(1, 1, 1)]}}, "not an integer"),
    ({"worlds": {"1": [point(1, 1, 1)]}}, "world >= 2"),
    ({"worlds": {"2": []}}, "at least one point"),
    ({"worlds": {"2": [point(0, 1, 1)]}}, "row_bytes must be a positive integer"),
    ({"worlds": {"2": [point(8, -1, 1)]}}, "oneshot_max must be an integer >= 0"),
    ({"worlds": {"2": [point(8, 1, 0)]}}, "twoshot_max must be a positive integer or null"),
    ({"worlds": {"2": [point(8, 1, 2), point(8, 3, 4)]}}, "lists a row size twice"),
])
def test_malformed_tables_are_rejected_with_the_entry_named(bad, message):
    with pytest.raises(ValueError, match=message):
        CrossoverTable.from_dict(bad, source="x.json")


# The fit -----------------------------------------------------------------------------------------------


def sweep_sizes(messages, a, b, noise=()):
    """One-shot fastest up to messages[a], two-shot up to messages[b], NCCL above; ``noise``: indices
    where the runner-up is within 0.5 % (still slower)."""
    sizes = []
    for i, m in enumerate(messages):
        base = 10.0 + m / 1e5
        winner = ONE if i <= a else TWO if i <= b else NCCL
        times = {impl: base * (1.0 if impl == winner else 1.005 if i in noise else 1.3) for impl in (ONE, TWO, NCCL)}
        sizes.append((m, times))
    return sizes


def test_a_limit_between_neighbours_one_byte_apart_stays_below_the_larger():
    messages = [(1 << 28) - 1, 1 << 28, (1 << 28) + 1]
    assert crossover_table.candidates(messages) == [0, (1 << 28) - 1, 1 << 28, (1 << 28) + 1]
    one, two, worst, _ = crossover_table.fit(sweep_sizes(messages, 0, 1))
    assert (one, two, worst) == ((1 << 28) - 1, 1 << 28, 1.0)


@settings(max_examples=80, deadline=None)
@given(st.integers(3, 9), st.data())
def test_fit_picks_the_fastest_at_every_measured_size_when_the_crossovers_are_clean(n, data):
    messages = sorted(data.draw(st.sets(st.integers(1 << 10, 1 << 28), min_size=n, max_size=n)))
    a = data.draw(st.integers(-1, n - 1))
    b = data.draw(st.integers(a, n - 1))
    sizes = sweep_sizes(messages, a, b)
    one, two, worst, lamport = crossover_table.fit(sizes)
    assert lamport == 0  # not timed: never picked
    for m, times in sizes:
        assert crossover_table.choose(m, one, two) == min(times, key=times.get), (m, one, two)
    assert worst == pytest.approx(1.0)
    # the limits sit between the last size of a kernel and the first of the next
    if 0 <= a < n - 1:
        assert messages[a] <= one < messages[a + 1]


def test_fit_never_picks_an_untimed_implementation_and_stops_one_shot_at_the_cap():
    messages = [1 << k for k in range(14, 29, 2)]  # 16 KiB .. 256 MiB
    sizes = sweep_sizes(messages, a=len(messages) - 1, b=len(messages) - 1)
    capped = [(m, {k: v for k, v in t.items() if k != ONE or m <= 32 * MiB}) for m, t in sizes]
    one, two, _, _ = crossover_table.fit(capped)
    assert one < 64 * MiB  # one-shot was not timed above 32 MiB
    for m, times in capped:
        assert crossover_table.choose(m, one, two) in times


def test_build_table_fits_each_world_and_row_and_keeps_unmeasured_worlds(tmp_path):
    rows = []
    for world, hidden, a in ((2, 4096, 3), (2, 8192, 4), (4, 8192, 1)):
        messages = [t * hidden * 2 for t in (1, 16, 64, 256, 1024, 4096, 8192)]
        for m, times in sweep_sizes(messages, a, 5):
            rows.append({"world": world, "row_bytes": hidden * 2, "bytes": m, "times": times})
    previous = {"machine": "m", "worlds": {"8": [point(16384, 512 << 10, 256 * MiB)]}}
    table, report = crossover_table.build_table(rows, previous, source="sweep.json")
    assert sorted(table["worlds"], key=int) == ["2", "4", "8"]
    assert table["worlds"]["8"] == previous["worlds"]["8"]
    assert any("kept from the current table" in line for line in report)
    path = tmp_path / "crossovers.json"
    path.write_text(json.dumps(table))
    loaded = CrossoverTable.load(str(path))
    w2 = loaded.limits(2, 16384)
    assert 1024 * 16384 <= w2.oneshot_max < 4096 * 16384      # one-shot fastest through 1024 tokens
    assert 4096 * 16384 <= w2.twoshot_max < 8192 * 16384      # two-shot through 4096
    assert loaded.limits(4, 16384).oneshot_max < 64 * 16384   # world 4: one-shot only up to 16 tokens
    between = loaded.limits(2, 12288)                         # hidden 6144: interpolated
    assert loaded.limits(2, 8192).oneshot_max < between.oneshot_max < w2.oneshot_max
    t = math.log(12288 / 8192) / math.log(16384 / 8192)
    low = loaded.limits(2, 8192).oneshot_max
    assert between.oneshot_max == pytest.approx(math.exp(math.log(low) + t * math.log(w2.oneshot_max / low)), rel=1e-6)


def test_fit_is_not_moved_by_a_near_tie():
    messages = [1 << k for k in range(14, 29, 2)]
    clean = crossover_table.fit(sweep_sizes(messages, 3, 5))
    noisy = crossover_table.fit(sweep_sizes(messages, 3, 5, noise=(2, 3, 4)))
    assert clean[:2] == noisy[:2]


# The pipelined Lamport two-shot (issue 30) ------------------------------------------------------------


def test_lamport_limit_is_optional_parsed_checked_and_interpolated():
    table = make({2: [point(4096, 1 * MiB, 16 * MiB), point(16384, 4 * MiB, 256 * MiB, 64 * MiB, True)]})
    assert table.limits(2, 4096).lamport_max == 0         # absent: never (tables from before the kernel)
    assert table.limits(2, 16384).lamport_max == 64 * MiB
    assert table.limits(2, 6000).lamport_max == 0         # 0 is not interpolated: the nearer point
    both = make({2: [point(4096, 1 * MiB, 16 * MiB, 16 * MiB, True), point(16384, 4 * MiB, 256 * MiB, 64 * MiB, True)]})
    assert both.limits(2, 8192).lamport_max == 32 * MiB   # halfway in log(row bytes)
    unlimited = make({2: [point(4096, 1 * MiB, 16 * MiB, None, True)]})
    assert unlimited.limits(2, 4096).lamport_max is None
    with pytest.raises(ValueError, match="lamport_max must be an integer >= 0 or null"):
        make({2: [point(4096, 1, 2, -1, True)]})


def test_backend_lamport_limit_follows_the_table_and_the_two_shot_setting(monkeypatch):
    from opfuse.families.residual_norm import cuda

    assert cuda.lamport_limit(2, 16384) == crossovers.table().limits(2, 16384).lamport_max
    with opfuse.config.override(twoshot_max_bytes=67890):  # a setting never turns on a kernel the table keeps off
        assert cuda.lamport_limit(3, 8192) == 0
    for limit, bounded in ((None, 67890), (1 << 30, 67890), (1000, 1000)):
        table = crossovers.CrossoverTable.from_dict(
            {"worlds": {"2": [{"row_bytes": 16384, "oneshot_max": 0, "twoshot_max": None, "lamport_max": limit}]}})
        monkeypatch.setattr(cuda.crossovers, "table", lambda table=table: table)
        assert cuda.lamport_limit(2, 16384) == limit
        with opfuse.config.override(twoshot_max_bytes=67890):
            assert cuda.lamport_limit(2, 16384) == bounded


def lamport_sweep(messages, a, b, c):
    """One-shot fastest up to messages[a], Lamport up to messages[b], the flag two-shot up to
    messages[c], NCCL above."""
    sizes = []
    for i, m in enumerate(messages):
        base = 10.0 + m / 1e5
        winner = ONE if i <= a else LAMPORT if i <= b else TWO if i <= c else NCCL
        sizes.append((m, {impl: base * (1.0 if impl == winner else 1.2) for impl in (ONE, LAMPORT, TWO, NCCL)}))
    return sizes


@settings(max_examples=60, deadline=None)
@given(st.integers(3, 8), st.data())
def test_fit_places_the_lamport_kernel_between_one_shot_and_two_shot(n, data):
    messages = sorted(data.draw(st.sets(st.integers(1 << 10, 1 << 28), min_size=n, max_size=n)))
    a = data.draw(st.integers(-1, n - 1))
    b = data.draw(st.integers(a, n - 1))
    c = data.draw(st.integers(b, n - 1))
    sizes = lamport_sweep(messages, a, b, c)
    one, two, worst, lamport = crossover_table.fit(sizes)
    for m, times in sizes:
        assert crossover_table.choose(m, one, two, lamport) == min(times, key=times.get), (m, one, lamport, two)
    assert worst == pytest.approx(1.0)
    if b == a:
        assert lamport == 0  # never the fastest: fitted out
    table, _ = crossover_table.build_table(
        [{"world": 2, "row_bytes": 16384, "bytes": m, "times": t} for m, t in sizes], None, source="sweep.json")
    limits = CrossoverTable.from_dict(table).limits(2, 16384)
    above_the_sweep = lambda limit: None if limit >= messages[-1] else limit  # noqa: E731
    assert (limits.oneshot_max, limits.lamport_max, limits.twoshot_max) == (one, above_the_sweep(lamport),
                                                                             above_the_sweep(two))


def test_a_forced_lamport_kernel_runs_past_the_table_that_keeps_it_off(monkeypatch):
    """Where the shipped table keeps the Lamport kernel off (not measured: world 3 here), forcing it
    is how the bench and the GPU tests reach it, so the table's limit must not refuse a forced call."""
    from opfuse.families.residual_norm import cuda

    spec = CallSpec("allreduce_add_rmsnorm", {"x": TensorMeta((4096, 8192), torch.bfloat16, torch.device("cuda", 0))},
                    {"norm": "rms"}, group_name="tp", world_size=3)
    monkeypatch.setattr(cuda, "_kernel_reason", lambda spec: None)
    monkeypatch.setattr(cuda.extension, "load", lambda family: type("Ext", (), {"MAX_WORLD": 8}))
    monkeypatch.setattr(cuda.symm_pool, "lookup", lambda group, device=None: (None, "no pool here"))
    assert "not used" in cuda.check_lamport(spec)
    with opfuse.config.override(force_impl="allreduce_add_rmsnorm=cuda_twoshot_lamport"):
        assert cuda.check_lamport(spec) == "no peer memory: no pool here"  # past the limit, on to capability


def test_the_winner_of_the_largest_measured_size_keeps_it_above_the_sweep():
    """A Lamport or two-shot limit at the largest measured message is written as no limit: NCCL must
    not take over at a size nobody measured just because the sweep stopped there."""
    messages = [t * 16384 for t in (1, 16, 256, 1024, 4096, 8192)]
    rows = []
    for i, m in enumerate(messages):
        base = 10.0 + m / 1e5
        winner = ONE if i <= 1 else LAMPORT
        times = {impl: base * (1.0 if impl == winner else 1.3) for impl in (ONE, LAMPORT, TWO, NCCL)}
        rows.append({"world": 2, "row_bytes": 16384, "bytes": m, "times": times})
    # two-shot wins only the largest size of a second row: two-shot above the sweep, Lamport capped
    for i, m in enumerate(messages):
        base = 10.0 + m / 1e5
        winner = ONE if i <= 1 else LAMPORT if i < len(messages) - 1 else TWO
        times = {impl: base * (1.0 if impl == winner else 1.3) for impl in (ONE, LAMPORT, TWO, NCCL)}
        rows.append({"world": 2, "row_bytes": 8192, "bytes": m, "times": times})
    table, report = crossover_table.build_table(rows, None, source="sweep.json")
    loaded = CrossoverTable.from_dict(table, source="fitted")
    assert loaded.limits(2, 16384).lamport_max is None and loaded.limits(2, 16384).twoshot_max is None
    capped = loaded.limits(2, 8192)
    assert 0 < capped.lamport_max < messages[-1] and capped.twoshot_max is None
    assert any("without limit" in line for line in report)
    for m in (messages[-1], 4 * messages[-1]):
        assert crossover_table.choose(m, capped.oneshot_max, math.inf, capped.lamport_max) == TWO


# Per-GPU tables ----------------------------------------------------------------------------------------

H100 = "NVIDIA H100 80GB HBM3"


def test_a_gpus_own_worlds_replace_the_defaults_world_by_world():
    table = CrossoverTable.from_dict({
        "worlds": {"2": [point(16384, 4 * MiB, None)], "4": [point(16384, 1 * MiB, None)]},
        "gpus": {H100: {"worlds": {"2": [point(16384, 2 * MiB, None)]}}}}, source="t")
    assert table.limits(2, 16384, H100).oneshot_max == 2 * MiB      # its own world 2
    assert table.limits(4, 16384, H100).oneshot_max == 1 * MiB      # world 4: the default's
    assert table.limits(3, 16384, H100).oneshot_max == 1 * MiB      # next larger listed world (4)
    for gpu in (None, "NVIDIA H200", "some other GPU"):
        assert table.limits(2, 16384, gpu).oneshot_max == 4 * MiB
    with pytest.raises(ValueError, match=r"gpus\['x'\] needs a non-empty 'worlds'"):
        CrossoverTable.from_dict({"worlds": {"2": [point(1, 1, 1)]}, "gpus": {"x": {}}}, source="t")
    with pytest.raises(ValueError, match=r"gpus\['x'\]: world 2 point 0: oneshot_max"):
        CrossoverTable.from_dict({"worlds": {"2": [point(1, 1, 1)]},
                                  "gpus": {"x": {"worlds": {"2": [point(8, -1, 1)]}}}})


def test_packaged_table_has_the_h100_sweep_for_world_2():
    table = crossovers.table()
    assert table.limits(2, 16384, H100) == Limits(2 * MiB, None, None)         # H100's sweep (session 8)
    assert table.limits(2, 16384, "NVIDIA H200").oneshot_max == 5931641        # the default (4x H200)
    assert table.limits(4, 16384, H100) == table.limits(4, 16384)              # not measured on H100


def test_the_peer_checks_read_the_limits_of_the_spec_s_gpu(monkeypatch):
    from opfuse.families.residual_norm import cuda

    table = CrossoverTable.from_dict({"worlds": {"2": [point(16384, 8 * MiB, None)]},
                                      "gpus": {H100: {"worlds": {"2": [point(16384, 1 * MiB, None)]}}}})
    monkeypatch.setattr(cuda.crossovers, "table", lambda: table)
    monkeypatch.setattr(cuda, "_kernel_reason", lambda spec: None)
    monkeypatch.setattr(cuda.extension, "load", lambda family: type("Ext", (), {"MAX_WORLD": 8}))
    monkeypatch.setattr(cuda.symm_pool, "lookup", lambda group, device=None: (None, "no pool here"))
    spec = CallSpec("allreduce_add_rmsnorm", {"x": TensorMeta((256, 8192), torch.bfloat16, torch.device("cuda", 0))},
                    {"norm": "rms"}, group_name="tp", world_size=2)  # 4 MiB
    for gpu, verdict in ((H100, "exceeds the oneshot limit of 1048576"), ("NVIDIA H200", "no peer memory")):
        monkeypatch.setattr(cuda, "device_name", lambda device, gpu=gpu: gpu)
        assert verdict in cuda.check_oneshot(spec), gpu


def test_fit_as_a_gpu_entry_keeps_the_default_and_other_gpus(tmp_path):
    messages = [t * 16384 for t in (1, 16, 256, 1024)]
    rows = [{"world": 2, "row_bytes": 16384, "bytes": m, "times": t} for m, t in sweep_sizes(messages, 1, 3)]
    previous = {"machine": "m", "worlds": {"2": [point(16384, 4 * MiB, None)]},
                "gpus": {"other": {"worlds": {"2": [point(16384, 3 * MiB, None)]}}}}
    table, report = crossover_table.build_gpu_entry(rows, previous, H100, "2x H100", "sweep.json")
    assert table["worlds"] == previous["worlds"] and table["gpus"]["other"] == previous["gpus"]["other"]
    assert table["gpus"][H100]["machine"] == "2x H100" and all(line.startswith(H100) for line in report)
    loaded = CrossoverTable.from_dict(table)
    assert 16 * 16384 <= loaded.limits(2, 16384, H100).oneshot_max < 256 * 16384
    assert loaded.limits(2, 16384).oneshot_max == 4 * MiB
