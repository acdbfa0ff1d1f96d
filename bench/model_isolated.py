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
``--pair "torchao fp8" "opfuse fp8" --fp8 tensor`` compares the FP8 variants); every run is a fresh
``bench/model.py --only`` process (its own NCCL group, compile and round-robin timing). Reported per
case: each run's time, the mean per variant, the spread (max / min - 1) within a variant, and
B / A of the means.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common  # noqa: E402  (bench/common.py)
from block_report import fmt, ratio  # noqa: E402

#: The variants bench/model.py's ``--only`` runs (its ONLY_CHOICES).
VARIANTS = ("compile", "opfuse", "opfuse fp8", "torchao fp8")


def run_order(rounds: int, pair=("compile", "opfuse")) -> list[str]:
    """The variants in the order they run: ``rounds`` times A B B A for ``pair = (A, B)``."""
    if rounds < 1:
        raise ValueError(f"--rounds {rounds}: must be >= 1")
    a, b = pair
    return [a, b, b, a] * rounds


def combine(runs: list[tuple[str, dict]], pair=("compile", "opfuse")) -> list[dict]:
    """One row per (world, case, shape) from ``[(variant, bench/model.py JSON), ...]``: the times of
    each variant's runs, their mean and spread, and B / A of the means for ``pair = (A, B)``."""
    base, ours = pair
    found: dict = {}
    for variant, data in runs:
        for world, result in data["results"].items():
            for row in result["rows"]:
                key = (world, row["case"], row["shape"])
                entry = found.setdefault(key, {"world": world, "case": row["case"], "shape": row["shape"],
                                               base: [], ours: []})
                if row.get(variant) is not None:
                    entry[variant].append(row[variant])
    rows = []
    for entry in found.values():
        for variant in pair:
            times = entry[variant]
            entry[f"{variant} mean"] = statistics.fmean(times) if times else None
            entry[f"{variant} spread"] = max(times) / min(times) - 1 if len(times) > 1 else None
        entry["ratio"] = ratio(entry[f"{ours} mean"], entry[f"{base} mean"])
        rows.append(entry)
    return rows


def table(rows: list[dict], pair=("compile", "opfuse")) -> str:
    a, b = pair
    out = [f"| world | case | shape | {a} runs | {b} runs | {a} mean | {b} mean | spread {a} | spread {b} | "
           f"{b} / {a} |", "|" + "---|" * 10]
    for r in rows:
        spread = lambda v: "-" if r[f"{v} spread"] is None else f"{100 * r[f'{v} spread']:.1f}%"  # noqa: E731
        out.append(f"| {r['world']} | {r['case']} | {r['shape']} | {' '.join(fmt(t) for t in r[a])} | "
                   f"{' '.join(fmt(t) for t in r[b])} | {fmt(r[f'{a} mean'])} | {fmt(r[f'{b} mean'])} | "
                   f"{spread(a)} | {spread(b)} | {fmt(r['ratio'], 3)} |")
    return "\n".join(out)


def run_times(data: dict, variant: str) -> str:
    """One run's step times (us), printed as the run ends, so a call cut off at its time limit still
    reports the runs it finished."""
    times = [f"{row['case']} {row['shape']}: {fmt(row.get(variant))} us"
             for result in data["results"].values() for row in result["rows"]]
    return "; ".join(times) or "no rows"


def measure(args, passthrough: list[str]) -> dict:
    runs, failed = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for index, variant in enumerate(run_order(args.rounds, args.pair)):
            path = os.path.join(scratch, f"run{index}.json")
            command = [sys.executable, os.path.join(HERE, "model.py"), "--only", variant, "--no-aa", "--json", path,
                       *passthrough]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.run_timeout)
            except subprocess.TimeoutExpired:
                failed.append(f"run {index + 1} ({variant}): still running after --run-timeout {args.run_timeout} s")
                common.progress(f"run {index + 1} {variant}: TIMED OUT")
                continue
            if done.returncode != 0 or not os.path.exists(path):
                tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
                failed.append(f"run {index + 1} ({variant}): exit {done.returncode}: {' | '.join(tail)[:300]}")
                common.progress(f"run {index + 1} {variant}: FAILED")
                continue
            with open(path) as handle:
                runs.append((variant, json.load(handle)))
            common.progress(f"run {index + 1} {variant}: {run_times(runs[-1][1], variant)}")
    return {"order": run_order(args.rounds, args.pair), "pair": list(args.pair), "rows": combine(runs, args.pair),
            "failed": failed}


def main() -> int:
    parser = common.parser("model_isolated", __doc__)
    parser.add_argument("--cases", nargs="+", choices=["train-tp", "train-sp"], default=["train-tp", "train-sp"])
    parser.add_argument("--pair", nargs=2, choices=VARIANTS, default=["compile", "opfuse"], metavar="VARIANT",
                        help=f"the two variants compared, A B (default compile opfuse; of {', '.join(VARIANTS)}; "
                             f"the fp8 ones need --fp8 tensor|row)")
    parser.add_argument("--fp8", choices=["tensor", "row"], default=None, help="bench/model.py's --fp8 recipe")
    parser.add_argument("--rounds", type=int, default=1, help="repetitions of A B B A (default 1: four runs)")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--cpu", action="store_true", help="gloo + CPU dry run (timings mean nothing)")
    args, passthrough = parser.parse_known_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be >= 1")
    if args.pair[0] == args.pair[1]:
        parser.error(f"--pair {' '.join(args.pair)}: two different variants")
    if any("fp8" in v for v in args.pair) and not args.fp8:
        parser.error(f"--pair {' '.join(args.pair)}: the fp8 variants need --fp8 tensor|row")
    refused = [flag for flag in passthrough if flag.split("=")[0] in ("--only", "--variants", "--merge-ab",
                                                                       "--decode", "--no-aa", "--profile")]
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
