#!/usr/bin/env python3
"""Turn a crossover sweep (bench/allreduce_crossover.py --json) into the dispatch table
``opfuse/families/residual_norm/crossovers.json``.

    python3 tools/crossover_table.py sweep.json            # rewrite the packaged table
    python3 tools/crossover_table.py sweep.json --dry-run  # print the fitted limits only
    python3 tools/crossover_table.py sweep.json --gpu auto # the fit as the sweep's GPU's own entry

For every measured (world, row bytes), the three limits are chosen together so that the order the
backend applies (one-shot up to ``oneshot_max``, the pipelined Lamport two-shot up to
``lamport_max``, the flag-based two-shot up to ``twoshot_max``, NCCL + the local kernel above)
loses the least against the fastest forced implementation over the measured sizes: the sum over
sizes of log(time of the implementation the limits pick / fastest time), where an implementation
without a time (not capable, not timed) counts as 10x slower. Candidate limits lie between
measured messages (their geometric mean), or at the largest measured message; ties go to the
smaller one-shot limit, the larger two-shot limit, and a Lamport limit of 0 when it would pick the
Lamport kernel nowhere (sweeps from before the Lamport kernel, which have no time for it,
therefore fit it out). A Lamport or two-shot limit at the largest measured message is written
as no limit (null): above the sweep the kernels stay bandwidth-bound, so the implementation that
wins the largest measured size keeps winning, rather than NCCL taking over at an untested size.
Worlds the sweep did not measure keep their entries from the current table. With ``--gpu``, the
fit becomes that GPU's own entry (``gpus`` in the table), used on that GPU for the worlds it
lists. The sweep's automatic choice is not used: it only reports how the old table did.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from opfuse.families.residual_norm import crossovers  # noqa: E402

ONESHOT, LAMPORT, TWOSHOT, NCCL = "cuda_oneshot", "cuda_twoshot_lamport", "cuda_twoshot", "nccl+cuda"
MISSING_PENALTY = math.log(10.0)


def choose(message: int, oneshot_max: int, twoshot_max: int, lamport_max: int = 0) -> str:
    """The implementation the backend picks for ``message`` under these limits."""
    if message <= oneshot_max:
        return ONESHOT
    if message <= lamport_max:
        return LAMPORT
    if message <= twoshot_max:
        return TWOSHOT
    return NCCL


def loss(sizes: list[tuple[int, dict]], oneshot_max: int, twoshot_max: int, lamport_max: int = 0) -> float:
    total = 0.0
    for message, times in sizes:
        best = min(times.values())
        got = times.get(choose(message, oneshot_max, twoshot_max, lamport_max))
        total += MISSING_PENALTY if got is None else math.log(got / best)
    return total


def candidates(messages: list[int]) -> list[int]:
    """0, a limit between each pair of neighbouring measured messages (their geometric mean,
    rounded down, so it stays in ``[a, b)`` even for neighbours one byte apart), and the largest one."""
    between = [math.isqrt(a * b) for a, b in zip(messages, messages[1:])]
    return [0] + between + [messages[-1]]


def fit(sizes: list[tuple[int, dict]]) -> tuple[int, int, float, int]:
    """``(oneshot_max, twoshot_max, worst ratio to the fastest, lamport_max)`` for one (world, row
    bytes).

    ``sizes``: ``(message bytes, {implementation: us})`` for the measured token counts; sizes
    with no time at all are ignored.
    """
    sizes = sorted((m, t) for m, t in sizes if t)
    if not sizes:
        raise ValueError("no measured size")
    cands = candidates([m for m, _ in sizes])
    best = None
    for one in cands:
        # Lamport limits at or below the one-shot's never pick it: one candidate (0) stands for all.
        lamports = [0] + [c for c in reversed(cands) if c > one]  # larger first: ties keep the larger
        for lam in lamports:
            for two in reversed(cands):  # larger two-shot limits first: ties keep the larger
                if two < max(one, lam):
                    continue
                value = loss(sizes, one, two, lam)
                if best is None or value < best[0] - 1e-12:
                    best = (value, one, two, lam)
    _, one, two, lam = best
    if two <= 0:  # the table needs a positive two-shot limit; 1 byte: never (smaller messages go first)
        two = 1
    worst = max((t.get(choose(m, one, two, lam), math.inf) / min(t.values()) for m, t in sizes), default=1.0)
    return one, two, worst, lam


def _limit(limit: int | None) -> str:
    return "without limit" if limit is None else "never" if limit <= 0 else f"<= {limit / 2**20:.3g} MiB"


def build_table(rows: list[dict], previous: dict | None = None, source: str = "") -> tuple[dict, list[str]]:
    """The table's JSON form from the sweep rows, and a line per fitted point for the report."""
    groups: dict[tuple[int, int], list[tuple[int, dict]]] = {}
    for row in rows:
        groups.setdefault((row["world"], row["row_bytes"]), []).append((row["bytes"], row["times"]))
    worlds: dict[str, list[dict]] = {}
    report = []
    for (world, row_bytes), sizes in sorted(groups.items()):
        if not any(t for _, t in sizes):
            continue
        one, two, worst, lam = fit(sizes)
        largest = max(m for m, t in sizes if t)
        lam_limit = None if lam >= largest else lam
        two_limit = None if two >= largest else two
        worlds.setdefault(str(world), []).append({"row_bytes": row_bytes, "oneshot_max": one,
                                                  "lamport_max": lam_limit, "twoshot_max": two_limit,
                                                  "worst_ratio": round(worst, 4)})
        report.append(f"world {world}, {row_bytes}-byte rows: one-shot <= {one / 2**20:.3g} MiB, Lamport two-shot "
                      f"{_limit(lam_limit)}, two-shot {_limit(two_limit)}; worst measured size "
                      f"{worst:.3f}x the fastest")
    for world, entries in (previous or {}).get("worlds", {}).items():
        if world not in worlds:
            worlds[world] = entries
            report.append(f"world {world}: not in the sweep, kept from the current table")
    table = {"comment": ("Largest message (bytes per rank) for the one-shot, the pipelined Lamport two-shot and the "
                         "flag-based two-shot all-reduce + add + norm kernels (null: no limit; lamport_max 0: "
                         "never), by world size and row bytes; 'gpus': worlds measured on that GPU, used there instead "
                         "of the default's (lookup rules: crossovers.py). Written by tools/crossover_table.py; "
                         "worst_ratio: the fitted limits' worst time over the fastest forced implementation at the "
                         "measured sizes."),
             "machine": (previous or {}).get("machine", ""), "source": source,
             "worlds": dict(sorted(worlds.items(), key=lambda kv: int(kv[0])))}
    if (previous or {}).get("gpus"):
        table["gpus"] = previous["gpus"]
    crossovers.CrossoverTable.from_dict(table, source="fitted table")  # the lookup must accept it
    return table, report


def build_gpu_entry(rows: list[dict], previous: dict, gpu: str, machine: str, source: str) -> tuple[dict, list[str]]:
    """``previous`` with the sweep's fit stored as GPU ``gpu``'s own worlds (``gpus[gpu]``); the
    default worlds and other GPUs' entries are kept, and worlds the sweep did not measure fall back
    to the default at lookup."""
    fitted, report = build_table(rows, None, source)
    table = dict(previous)
    table["gpus"] = dict(previous.get("gpus", {}))
    table["gpus"][gpu] = {"machine": machine, "source": source, "worlds": fitted["worlds"]}
    crossovers.CrossoverTable.from_dict(table, source="fitted table")
    return table, [f"{gpu}: {line}" for line in report]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", help="JSON written by bench/allreduce_crossover.py --json")
    parser.add_argument("--out", default=crossovers.TABLE_PATH, help="where to write (default: the packaged table)")
    parser.add_argument("--previous", default=crossovers.TABLE_PATH,
                        help="table whose unmeasured worlds are kept (default: the packaged table)")
    parser.add_argument("--machine", default=None, help="machine kind to record (default: the sweep's device)")
    parser.add_argument("--gpu", default=None,
                        help="store the fit as this GPU's own entry (the driver's name; 'auto': the sweep's "
                             "device) instead of the default worlds")
    parser.add_argument("--dry-run", action="store_true", help="print the fitted limits, write nothing")
    args = parser.parse_args()
    with open(args.sweep) as handle:
        sweep = json.load(handle)
    previous = None
    if os.path.isfile(args.previous):
        with open(args.previous) as handle:
            previous = json.load(handle)
    meta = sweep.get("meta", {})
    command = meta.get("command", "bench/allreduce_crossover.py")
    source = f"{os.path.basename(args.sweep)}: {command} ({meta.get('date', '?')})"
    if args.gpu:
        gpu = meta.get("device") if args.gpu == "auto" else args.gpu
        if not gpu or previous is None:
            parser.error(f"--gpu {args.gpu}: needs the sweep's device name (meta.device) and a --previous table")
        table, report = build_gpu_entry(sweep["rows"], previous, gpu, args.machine or gpu, source)
    else:
        table, report = build_table(sweep["rows"], previous, source)
        table["machine"] = args.machine or meta.get("device", table["machine"])
    print("\n".join(report))
    if not args.dry_run:
        with open(args.out, "w") as handle:
            json.dump(table, handle, indent=1)
            handle.write("\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
