#!/usr/bin/env python3
"""Turn a recorded ``bench/allreduce_norm.py`` output (docs/measurements/allreduce_*.txt: the
tables it printed) back into the rows its ``--json`` writes, so ``--from-json`` can print and plot
published numbers without GPUs:

    python3 tools/allreduce_table_to_json.py docs/measurements/allreduce_v3_w2w4.txt > rows.json
    python3 bench/allreduce_norm.py --from-json rows.json --plot docs/img/allreduce_norm.png

Only what the tables hold is filled in (derived ratio columns are recomputed by the bench);
a ``-`` cell becomes ``null``.
"""

from __future__ import annotations

import json
import re
import sys

# Table header -> row key of bench/allreduce_norm.py (the columns its table() prints).
COLUMNS = {
    "tokens": "tokens", "NCCL AR": "nccl_ar", "NCCL+eager": "nccl_eager", "NCCL+compiled": "nccl_compiled",
    "symm1+eager": "symm1_eager", "symm2 AR": "symm2_ar", "ours": "ours", "impl": "ours_impl",
    "ours 1shot": "ours_1shot", "ours 2shot": "ours_2shot", "ours nccl": "ours_nccl", "AR ours": "ours_ar",
}
HEADER = re.compile(r"^world (\d+), (\d+) hidden")


def _value(cell: str):
    cell = cell.strip()
    if cell == "-":
        return None
    try:
        return float(cell)
    except ValueError:
        return cell


def parse(text: str) -> dict:
    """``{world: [row, ...]}`` from the tables in ``text``."""
    results, world, hidden, head = {}, None, None, None
    for line in text.splitlines():
        found = HEADER.match(line)
        if found:
            world, hidden, head = found.group(1), int(found.group(2)), None
            continue
        if line.startswith("summary"):  # the bench's closing summary table is not a world's table
            world = None
            continue
        if not line.startswith("|") or world is None:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if head is None:
            head = cells
            continue
        if set(line) <= set("|-"):
            continue
        raw = dict(zip(head, cells))
        row = {"hidden": hidden, "bytes": int(raw["bytes"].split()[0]) << 10}
        row.update({key: _value(raw[name]) for name, key in COLUMNS.items() if name in raw})
        row["tokens"] = int(row["tokens"])
        # "add+norm ours/compiled" reads "0.81 (3.5/4.3)": the two times are in the parentheses.
        times = re.search(r"\(([\d.]+)/([\d.]+)\)", raw.get("add+norm ours/compiled", ""))
        if times:
            row["addnorm_ours"], row["addnorm_compiled"] = float(times.group(1)), float(times.group(2))
        results.setdefault(world, []).append(row)
    return results


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: tools/allreduce_table_to_json.py docs/measurements/allreduce_....txt", file=sys.stderr)
        return 2
    with open(argv[0]) as handle:
        results = parse(handle.read())
    if not results:
        print(f"{argv[0]}: no 'world N, H hidden' table found", file=sys.stderr)
        return 1
    json.dump(results, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
