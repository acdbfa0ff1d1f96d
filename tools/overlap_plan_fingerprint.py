"""Fingerprints of the comm + GEMM overlap plans, to show a refactor leaves them byte-identical.

    PYTHONPATH=. python3 tools/overlap_plan_fingerprint.py > /tmp/after.json
    diff <(python3 -m json.tool docs/measurements/overlap_plan_fingerprints.json) <(python3 -m json.tool /tmp/after.json)

For every case (world 2/3/4/8, every rank, forward and backward of both fused ops, several
shapes, ``OPFUSE_OVERLAP_CHUNKS`` 0/1/2/4, the second GEMM stream automatic / forced off / on,
132 and 114 SMs) it asks the overlap implementation for the plan it would run, through the same
function a call uses, with a CPU stand-in for the symmetric pool, and records the sha256 of the
plan's repr plus the regions (name, bytes) the implementation reserves for it. CPU only.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys

from opfuse.families.collective_linear.overlap import planner as overlap_plans
from opfuse.config import config

K, FFN = 8192, 28672


class _Region:
    def __init__(self, name: str, nbytes: int):
        self.name, self.nbytes = name, nbytes


class _Pool:
    """Records reservations; never full."""

    def __init__(self):
        self.reserved: dict[str, int] = {}

    def reserve(self, name: str, nbytes: int):
        self.reserved[name] = max(nbytes, self.reserved.get(name, 0))
        return _Region(name, nbytes)


def _cases():
    for world in (2, 3, 4, 8):
        for tokens in (1024, 2048, 8192, 24 * 7):
            if tokens % world:
                continue
            rows, n = tokens // world, FFN // world
            yield world, rows, n


def main() -> int:
    out = {}
    for (world, rows, n), setting, alternate, sms in itertools.product(
            _cases(), (0, 1, 2, 4), ("auto", "off", "on"), (132, 114)):
        with config.override(overlap_chunks=setting, overlap_alternate_streams=alternate):
            for rank in range(world):
                for name, request in overlap_plans.fingerprint_requests(rows, K, n):
                    pool = _Pool()
                    plan = overlap_plans.plan_for(request, rank=rank, world=world, sms=sms, pool=pool)
                    key = f"w{world}/r{rank}/rows{rows}/n{n}/chunks{setting}/alt{alternate}/sms{sms}/{name}"
                    text = repr(plan) + repr(sorted(pool.reserved.items()))
                    out[key] = hashlib.sha256(text.encode()).hexdigest()[:16]
    json.dump(out, sys.stdout, indent=0, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
