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

Method: ``--rounds`` repetitions of A B B A (A = torch.compile, B = opfuse); every run is a fresh
``bench/model.py --only`` process (its own NCCL group, compile and round-robin timing). Reported per
case: each run's time, the mean per variant, the spread (max / min - 1) within a variant, and
opfuse / torch.compile of the means.
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

ORDER = ("compile", "opfuse", "opfuse", "compile")


def run_order(rounds: int) -> list[str]:
    """The variants in the order they run: ``rounds`` times A B B A."""
    if rounds < 1:
        raise ValueError(f"--rounds {rounds}: must be >= 1")
    return list(ORDER) * rounds


def combine(runs: list[tuple[str, dict]]) -> list[dict]:
    """One row per (world, case, shape) from ``[(variant, bench/model.py JSON), ...]``: the times of
    each variant's runs, their mean and spread, and opfuse / compile of the means."""
    found: dict = {}
    for variant, data in runs:
        for world, result in data["results"].items():
            for row in result["rows"]:
                key = (world, row["case"], row["shape"])
                entry = found.setdefault(key, {"world": world, "case": row["case"], "shape": row["shape"],
                                               "compile": [], "opfuse": []})
                if row.get(variant) is not None:
                    entry[variant].append(row[variant])
    rows = []
    for entry in found.values():
        for variant in ("compile", "opfuse"):
            times = entry[variant]
            entry[f"{variant} mean"] = statistics.fmean(times) if times else None
            entry[f"{variant} spread"] = max(times) / min(times) - 1 if len(times) > 1 else None
        entry["ratio"] = ratio(entry["opfuse mean"], entry["compile mean"])
        rows.append(entry)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| world | case | shape | compile runs | opfuse runs | compile mean | opfuse mean | spread compile | "
           "spread opfuse | opfuse / compile |", "|" + "---|" * 10]
    for r in rows:
        spread = lambda v: "-" if r[f"{v} spread"] is None else f"{100 * r[f'{v} spread']:.1f}%"  # noqa: E731
        out.append(f"| {r['world']} | {r['case']} | {r['shape']} | {' '.join(fmt(t) for t in r['compile'])} | "
                   f"{' '.join(fmt(t) for t in r['opfuse'])} | {fmt(r['compile mean'])} | {fmt(r['opfuse mean'])} | "
                   f"{spread('compile')} | {spread('opfuse')} | {fmt(r['ratio'], 3)} |")
    return "\n".join(out)


def measure(args, passthrough: list[str]) -> dict:
    runs, failed = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for index, variant in enumerate(run_order(args.rounds)):
            path = os.path.join(scratch, f"run{index}.json")
            command = [sys.executable, os.path.join(HERE, "model.py"), "--only", variant, "--no-aa", "--json", path,
                       *passthrough]
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.run_timeout)
            if done.returncode != 0 or not os.path.exists(path):
                tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
                failed.append(f"run {index + 1} ({variant}): exit {done.returncode}: {' | '.join(tail)[:300]}")
                common.progress(f"run {index + 1} {variant}: FAILED")
                continue
            with open(path) as handle:
                runs.append((variant, json.load(handle)))
            common.progress(f"run {index + 1} {variant}: done")
    return {"order": run_order(args.rounds), "rows": combine(runs), "failed": failed}


def main() -> int:
    parser = common.parser("model_isolated", __doc__)
    parser.add_argument("--cases", nargs="+", choices=["train-tp", "train-sp"], default=["train-tp", "train-sp"])
    parser.add_argument("--rounds", type=int, default=1, help="repetitions of A B B A (default 1: four runs)")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--cpu", action="store_true", help="gloo + CPU dry run (timings mean nothing)")
    args, passthrough = parser.parse_known_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be >= 1")
    refused = [flag for flag in passthrough if flag.split("=")[0] in ("--only", "--variants", "--fp8", "--merge-ab",
                                                                       "--decode", "--no-aa", "--profile")]
    if refused:
        parser.error(f"{' '.join(refused)}: not for this script (it sets --only per run and times the training "
                     f"cases); pass bench/model.py's --world, --train, --train-batch, --layers, --quick")
    passthrough += ["--cases", *args.cases]
    if args.cpu:
        passthrough.append("--cpu")
    if args.from_json:
        data = common.load_json(args.from_json)
    else:
        if not args.cpu and common.skip_without_gpus("model_isolated", 2):
            return 0
        data = measure(args, passthrough)
    print(f"\neach variant alone in its own process, order {' '.join(data['order'])}; microseconds per step "
          f"(max over ranks)")
    print(table(data["rows"]))
    for line in data["failed"]:
        print(f"note: {line}")
    if args.cpu:
        print("\n(--cpu: a dry run of the code paths on gloo; the timings mean nothing)")
    common.finish(args, data)
    return 0 if data["rows"] and not data["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
