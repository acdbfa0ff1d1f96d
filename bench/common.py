"""What every benchmark shares: the list of benchmarks, the common flags (``--json``, ``--plot``,
``--from-json``), progress lines, the no-GPU skip, and the charts.

A benchmark's ``main()`` follows one shape::

    parser = common.parser("allreduce_norm", __doc__)
    ...                                   # its own flags
    args = parser.parse_args()
    data = common.results(args, "allreduce_norm", min(args.world), measure)
    if data is None:
        return 0                          # "no GPU: allreduce_norm needs 2 CUDA GPUs; skipped"
    ...print its tables from data...      # measure() calls common.progress("...") after each case
    common.finish(args, data, series=..., title=...)   # --json, --plot

``--from-json FILE`` re-reads what ``--json FILE`` wrote (no GPU needed): the tables are printed
and ``--plot`` drawn again from recorded numbers. matplotlib is optional (``pip install
matplotlib``); without it ``--plot`` says so in one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

__all__ = ["BENCHMARKS", "parser", "results", "skip_without_gpus", "worlds", "run_ranks", "progress", "load_json",
           "finish", "plot_lines", "plot_bars"]

#: The benchmarks ``python -m opfuse bench`` runs: file name (bench/NAME.py) -> (CUDA GPUs needed,
#: what it measures). The other files of bench/ are helpers.
BENCHMARKS = {
    "allreduce_norm": (2, "all-reduce + bias + residual + RMSNorm vs NCCL, torch.compile, symm_mem, FlashInfer"),
    "allreduce_crossover": (2, "all-reduce + norm dispatch: every implementation forced vs the automatic choice"),
    "overlap": (2, "all-gather + GEMM and GEMM + reduce-scatter overlap vs the GEMM alone and NCCL"),
    "block": (2, "the whole tensor-parallel MLP block vs torch.nn and torch.compile (--cpu: gloo dry run)"),
    "model": (2, "a Llama-style decoder under opfuse's torch.compile backend vs torch.compile and eager (--cpu)"),
    "model_isolated": (2, "the training cases of model with each variant alone in a process, A B B A (--cpu)"),
    "grouped": (1, "MoE grouped GEMM vs torch._grouped_mm and a dense GEMM"),
    "moe": (1, "Mixtral-style MoE as Hugging Face writes it: opfuse's grouped rewrite vs torch.compile (--fp8, --cpu)"),
    "grouped_tune": (1, "grouped GEMM implementations and persistent tiles per size class: this GPU's table entries"),
    "horizontal": (1, "gate and up as one GEMM over the joined weight (horizontal_gemm) vs two GEMMs"),
    "nvidia_libs": (1, "cuDNN frontend and cuBLASMp implementations vs opfuse's and torch (optional libraries)"),
    "fp8": (1, "FP8 vs bf16: the MLP block (training, decode), the grouped GEMM, a short training run"),
    "push_bandwidth": (2, "copy-engine push bandwidth into peers vs NCCL all-gather"),
    "host_primitives": (1, "host issue cost of each torch primitive an eager overlap plan calls"),
    "host_overhead": (0, "host overhead of a compiled Sequential call over its ops (runs on CPU)"),
    "overlap_hostcost": (0, "Python cost of an eager overlap call, per plan, measured on CPU"),
}

_STARTED = time.perf_counter()


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` for ``bench/NAME.py`` with the common flags already added."""
    p = argparse.ArgumentParser(prog=f"bench/{name}.py", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, metavar="FILE", help="also write every measured row to FILE")
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="draw the ratio-vs-size chart to FILE (.png/.svg/.pdf; needs matplotlib)")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="measure nothing: print the tables (and --plot) from a file --json wrote")
    return p


def skip_without_gpus(name: str, needed: int) -> bool:
    """True (after printing the one-line notice) when this host has fewer than ``needed`` GPUs."""
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have >= needed:
        return False
    what = f"{needed} CUDA GPU" + ("s" if needed > 1 else "")
    print(f"no GPU: {name} needs {what} (this host has {have}); skipped" if have else
          f"no GPU: {name} needs {what}; skipped", flush=True)
    return True


def results(args, name: str, gpus: int, measure):
    """What a benchmark reports: the file ``--from-json`` names, else ``measure()``'s result;
    None (after the one-line notice) on a host with fewer than ``gpus`` GPUs."""
    if args.from_json:
        return load_json(args.from_json)
    if skip_without_gpus(name, gpus):
        return None
    return measure()


def worlds(requested) -> list[int]:
    """The world sizes of ``requested`` this host has GPUs for (the others: one line each)."""
    import torch

    have = torch.cuda.device_count()
    for world in requested:
        if world > have:
            print(f"world {world}: skipped, {have} GPUs", flush=True)
    return [world for world in requested if world <= have]


def run_ranks(worker, world: int, *args, backend: str = "nccl", timeout: float = 900.0):
    """Run ``worker(rank, world, *args, out_path)`` on ``world`` spawned ranks and return the
    JSON that rank 0 wrote to ``out_path``."""
    import tempfile

    from opfuse.cli.launch import run

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out_path = handle.name
    try:
        run(worker, world, *args, out_path, backend=backend, timeout=timeout)
        return load_json(out_path)
    finally:
        os.unlink(out_path)


def progress(message: str) -> None:
    """One progress line on stderr (stdout keeps the tables), with the seconds since start."""
    print(f"[{time.perf_counter() - _STARTED:6.0f} s] {message}", file=sys.stderr, flush=True)


def load_json(path: str):
    with open(path) as handle:
        return json.load(handle)


def finish(args, data, *, series=None, bars=None, title: str = "", xlabel: str = "", ylabel: str = "",
           baseline: float | None = 1.0) -> None:
    """Write ``--json`` and draw ``--plot`` (lines from ``series``, with a dashed line at ``baseline``,
    or bars from ``bars``)."""
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(data, handle, indent=1)
        progress(f"wrote {args.json}")
    if args.plot:
        if series is not None:
            plot_lines(args.plot, series, title=title, xlabel=xlabel, ylabel=ylabel, baseline=baseline)
        else:
            plot_bars(args.plot, bars or {}, title=title, xlabel=ylabel)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib, or pip install 'opfuse[plot]'); no chart drawn",
              file=sys.stderr)
        return None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_lines(path: str, series: dict, *, title: str, xlabel: str, ylabel: str, baseline: float | None = 1.0):
    """One line per ``series`` entry (label -> [(size, value), ...]) over a log2 size axis; a dashed
    line at ``baseline`` (ratio 1 = as fast as the baseline)."""
    plt = _pyplot()
    if plt is None:
        return
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
    sizes = sorted({x for points in series.values() for x, y in points if y is not None})
    for label, points in series.items():
        points = sorted((x, y) for x, y in points if y is not None)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    if baseline is not None:
        ax.axhline(baseline, color="#888", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)  # the measured sizes, written out (not as powers of two)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    progress(f"wrote {path}")


def plot_bars(path: str, bars: dict, *, title: str, xlabel: str):
    """Horizontal bars (label -> value), for benchmarks without a size axis."""
    plt = _pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7.5, 0.35 * len(bars) + 1.2), dpi=110)
    labels = list(bars)
    ax.barh(labels, [bars[k] for k in labels], color="#4c8bd6")
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    progress(f"wrote {path}")


def bench_dir() -> str:
    return os.path.dirname(os.path.abspath(__file__))
