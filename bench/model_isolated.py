"""The training cases of bench/model.py with each variant alone in its own process: torch.compile
and opfuse run one after the other (``bench/model.py --only VARIANT``), in A B B A order, and the
ratio is taken between the means of the runs.

Why: inside one process, two *identical* torch.compile models timed side by side differ by 3.6-7%
(the A/A control, ``compile:again``, that bench/model.py adds to every training case), which is as
large as the differences being measured. Each process here holds one compiled model; the A B B A
order cancels a linear drift of the GPU's clocks across the runs.

    PYTHONPATH=. python3 bench/model_isolated.py --cases train-sp --train 2048 --train-batch 1
    PYTHONPATH=. python3 bench/model_isolated.py --cases train-tp train-sp --rounds 2 --json out.json
    python3 bench/model_isolated.py --cpu --cases train-tp --train 16   # the code paths (gloo; no timings)

Method: ``--rounds`` repetitions of A B B A (``--pair A B``; default A = torch.compile, B = opfuse;
``--pair "torchao fp8" "opfuse fp8" --fp8 tensor`` compares the FP8 variants, ``--pair compile
"opfuse fp8@graphs" --fp8 tensor-pow2`` opfuse FP8 trained under CUDA graphs against torch.compile
without them; ``VARIANT%OP=IMPL`` runs a variant with ``OPFUSE_FORCE_IMPL=OP=IMPL``, e.g. ``--pair "opfuse
fp8@graphs" "opfuse fp8@graphs%linear_reduce_scatter_fp8=p2p_overlap"`` times one implementation
choice against the default, ``VARIANT%SETTING=VALUE`` (upper case) runs it with ``OPFUSE_SETTING=VALUE``,
e.g. ``--pair opfuse "opfuse%ALLREDUCE_CHUNKS=0"``; three or more variants run A B C C B A); every run is a fresh ``bench/model.py --only`` process (its own NCCL group,
compile and round-robin timing). Reported per case: each run's time, the mean per variant, the
spread (max / min - 1) within a variant, and each later variant's mean over A's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common  # noqa: E402  (bench/common.py)
from fp8_variants import RECIPE_NAMES as FP8_RECIPES  # noqa: E402
from block_report import fmt, ratio  # noqa: E402

#: The variants bench/model.py's ``--only`` runs (its ONLY_CHOICES).
VARIANTS = ("compile", "opfuse", "opfuse fp8", "torchao fp8")
#: ``VARIANT@graphs``: that variant trained under CUDA graphs (bench/model.py ``--train-mode reduce-overhead``).
GRAPHS = "@graphs"


#: ``VARIANT%OP=IMPL``: that variant with ``OPFUSE_FORCE_IMPL=OP=IMPL`` (an implementation choice timed alone);
#: ``VARIANT%SETTING=VALUE``: with ``OPFUSE_SETTING=VALUE``.
FORCE = "%"


def variant_of(entry: str) -> str:
    """The bench/model.py variant of a ``--pair`` entry (``"opfuse fp8@graphs%op=impl"`` -> ``"opfuse fp8"``)."""
    base = entry.split(FORCE, 1)[0]
    return base[:-len(GRAPHS)] if base.endswith(GRAPHS) else base


def under_graphs(entry: str) -> bool:
    """Whether a ``--pair`` entry trains under CUDA graphs (``...@graphs``)."""
    return entry.split(FORCE, 1)[0].endswith(GRAPHS)


def forced_impl(entry: str) -> str | None:
    """The ``%`` part of a ``--pair`` entry (``...%OP=IMPL`` or ``...%SETTING=VALUE``), else ``None``."""
    return entry.split(FORCE, 1)[1] if FORCE in entry else None


def entry_environment(entry: str) -> dict[str, str]:
    """The environment a ``--pair`` entry adds to its run: ``%OP=IMPL`` (a fused op, lower case) is
    ``OPFUSE_FORCE_IMPL=OP=IMPL``; ``%SETTING=VALUE`` (upper case, e.g. ``ALLREDUCE_CHUNKS=1``) is
    ``OPFUSE_SETTING=VALUE``."""
    extra = forced_impl(entry)
    if extra is None:
        return {}
    name = extra.split("=", 1)[0]
    if name.isupper() and "=" in extra:
        return {"OPFUSE_" + name: extra.split("=", 1)[1]}
    return {"OPFUSE_FORCE_IMPL": extra}


def _valid_entry(entry: str) -> str:
    if variant_of(entry) not in VARIANTS or forced_impl(entry) == "":
        raise argparse.ArgumentTypeError(f"{entry!r}: expected one of {', '.join(VARIANTS)}, each optionally with "
                                         f"{GRAPHS!r} (trained under CUDA graphs) and then {FORCE!r}OP=IMPL (run with "
                                         f"OPFUSE_FORCE_IMPL=OP=IMPL) or {FORCE!r}SETTING=VALUE (OPFUSE_SETTING=VALUE)")
    return entry


def run_order(rounds: int, pair=("compile", "opfuse")) -> list[str]:
    """The variants in the order they run: ``rounds`` times A B B A for ``pair = (A, B)`` (A B C C B
    A for three), so a linear drift of the GPU's clocks cancels in every mean."""
    if rounds < 1:
        raise ValueError(f"--rounds {rounds}: must be >= 1")
    return (list(pair) + list(reversed(pair))) * rounds


def combine(runs: list[tuple[str, dict]], pair=("compile", "opfuse")) -> list[dict]:
    """One row per (world, case, shape) from ``[(variant, bench/model.py JSON), ...]``: the times of
    each variant's runs, their mean and spread, and each later variant's mean over the first's
    (``ratio``: the second's; ``ratio V``: variant V's)."""
    base, ours = pair[0], pair[1]
    found: dict = {}
    for variant, data in runs:
        for world, result in data["results"].items():
            for row in result["rows"]:
                key = (world, row["case"], row["shape"])
                entry = found.setdefault(key, {"world": world, "case": row["case"], "shape": row["shape"],
                                               **{v: [] for v in pair}})
                if row.get(variant_of(variant)) is not None:
                    entry[variant].append(row[variant_of(variant)])
    rows = []
    for entry in found.values():
        for variant in pair:
            times = entry[variant]
            entry[f"{variant} mean"] = statistics.fmean(times) if times else None
            entry[f"{variant} spread"] = max(times) / min(times) - 1 if len(times) > 1 else None
        for variant in pair[1:]:
            entry[f"ratio {variant}"] = ratio(entry[f"{variant} mean"], entry[f"{base} mean"])
        entry["ratio"] = entry[f"ratio {ours}"]
        rows.append(entry)
    return rows


def table(rows: list[dict], pair=("compile", "opfuse")) -> str:
    base, later = pair[0], pair[1:]
    head = ([f"{v} runs" for v in pair] + [f"{v} mean" for v in pair] + [f"spread {v}" for v in pair]
            + [f"{v} / {base}" for v in later])
    out = ["| world | case | shape | " + " | ".join(head) + " |", "|" + "---|" * (3 + len(head))]
    for r in rows:
        spread = lambda v: "-" if r[f"{v} spread"] is None else f"{100 * r[f'{v} spread']:.1f}%"  # noqa: E731
        cells = ([" ".join(fmt(t) for t in r[v]) for v in pair] + [fmt(r[f"{v} mean"]) for v in pair]
                 + [spread(v) for v in pair] + [fmt(r[f"ratio {v}"], 3) for v in later])
        out.append(f"| {r['world']} | {r['case']} | {r['shape']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def run_times(data: dict, variant: str) -> str:
    """One run's step times (us), printed as the run ends, so a call cut off at its time limit still
    reports the runs it finished."""
    times = [f"{row['case']} {row['shape']}: {fmt(row.get(variant_of(variant)))} us"
             for result in data["results"].values() for row in result["rows"]]
    return "; ".join(times) or "no rows"


def measure(args, passthrough: list[str]) -> dict:
    runs, failed = [], []
    order = run_order(args.rounds, args.pair)
    # A discarded first run takes the cold machine's drift (session 12: four runs falling by ~1 ms
    # each after a cold start, 16% apart within one variant); it is the last variant of the order.
    warmups = [order[-1]] if getattr(args, "warmup_run", False) else []
    with tempfile.TemporaryDirectory() as scratch:
        for index, variant in enumerate(warmups + order):
            warmup = index < len(warmups)
            label = "warm-up run" if warmup else f"run {index + 1 - len(warmups)}"
            path = os.path.join(scratch, f"run{index}.json")
            command = [sys.executable, os.path.join(HERE, "model.py"), "--only", variant_of(variant), "--no-aa",
                       "--json", path, *passthrough]
            if under_graphs(variant):
                command += ["--train-mode", "reduce-overhead"]
            env = {**os.environ, **entry_environment(variant)}
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.run_timeout, env=env)
            except subprocess.TimeoutExpired:
                failed.append(f"{label} ({variant}): still running after --run-timeout {args.run_timeout} s")
                common.progress(f"{label} {variant}: TIMED OUT")
                continue
            if done.returncode != 0 or not os.path.exists(path):
                tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
                failed.append(f"{label} ({variant}): exit {done.returncode}: {' | '.join(tail)[:300]}")
                common.progress(f"{label} {variant}: FAILED")
                continue
            with open(path) as handle:
                data = json.load(handle)
            if warmup:
                common.progress(f"warm-up run ({variant}, discarded): {run_times(data, variant)}")
                continue
            runs.append((variant, data))
            common.progress(f"{label} {variant}: {run_times(runs[-1][1], variant)}")
    return {"order": order, "warm-up runs": warmups, "pair": list(args.pair), "rows": combine(runs, args.pair),
            "failed": failed}


def main() -> int:
    parser = common.parser("model_isolated", __doc__)
    parser.add_argument("--cases", nargs="+", choices=["train-tp", "train-sp"], default=["train-tp", "train-sp"])
    parser.add_argument("--pair", nargs="+", type=_valid_entry, default=["compile", "opfuse"], metavar="VARIANT",
                        help=f"the variants compared, A B [C ...] (default compile opfuse; of {', '.join(VARIANTS)}, "
                             f"each optionally with {GRAPHS} for training under CUDA graphs, e.g. 'opfuse fp8{GRAPHS}'; "
                             f"the fp8 ones need --fp8)")
    parser.add_argument("--fp8", choices=FP8_RECIPES, default=None, help="bench/model.py's --fp8 recipe")
    parser.add_argument("--rounds", type=int, default=1, help="repetitions of A B B A (default 1: four runs)")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--warmup-run", action="store_true",
                        help="one discarded run first (of the order's last variant), for a machine just started")
    parser.add_argument("--cpu", action="store_true", help="gloo + CPU dry run (timings mean nothing)")
    args, passthrough = parser.parse_known_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be >= 1")
    if len(args.pair) < 2 or len(set(args.pair)) != len(args.pair):
        parser.error(f"--pair {' '.join(args.pair)}: two different variants or more, each once")
    if any("fp8" in v for v in args.pair) and not args.fp8:
        parser.error(f"--pair {' '.join(args.pair)}: the fp8 variants need --fp8 {'|'.join(FP8_RECIPES)}")
    refused = [flag for flag in passthrough if flag.split("=")[0] in ("--only", "--variants", "--merge-ab",
                                                                       "--decode", "--no-aa", "--profile")
               or (flag.split("=")[0] == "--train-mode" and any(under_graphs(v) for v in args.pair))]
    if refused:
        parser.error(f"{' '.join(refused)}: not for this script (it sets --only per run and times the training "
                     f"cases); pass bench/model.py's --world, --train, --train-batch, --layers, --quick")
    passthrough += ["--cases", *args.cases] + (["--fp8", args.fp8] if args.fp8 else [])
    if args.cpu:
        passthrough.append("--cpu")
    if args.from_json:
        data = common.load_json(args.from_json)
    else:
        if not args.cpu and common.skip_without_gpus("model_isolated", 2):
            return 0
        data = measure(args, passthrough)
    print(f"\neach variant alone in its own process, order {', '.join(data['order'])}; microseconds per step "
          f"(max over ranks)")
    print(table(data["rows"], tuple(data.get("pair", ("compile", "opfuse")))))
    for line in data["failed"]:
        print(f"note: {line}")
    if args.cpu:
        print("\n(--cpu: a dry run of the code paths on gloo; the timings mean nothing)")
    common.finish(args, data)
    return 0 if data["rows"] and not data["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
