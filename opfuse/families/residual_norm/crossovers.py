"""Where the all-reduce + add + norm kernels hand over to each other, by world size and row size.

The implementations are tried in the order one-shot, pipelined Lamport two-shot, flag-based two-shot,
NCCL + the local kernel; a message (bytes per rank) goes to the first whose limit it does not
exceed. The limits come from
``crossovers.json`` next to this module, written by ``tools/crossover_table.py`` from a sweep of
``bench/allreduce_crossover.py`` (docs/PERF_NOTES.md). ``OPFUSE_ONESHOT_MAX_BYTES`` /
``OPFUSE_TWOSHOT_MAX_BYTES`` override them when non-zero (:mod:`.cuda`).

The table holds, per world size, points keyed by row bytes (hidden x element size), each with
``oneshot_max`` (bytes; 0: never one-shot), ``lamport_max`` (bytes; 0 or absent: never the Lamport
two-shot; null: no limit) and ``twoshot_max`` (bytes; null: no limit). Lookup:

- world: the smallest listed world >= the group's, else the largest listed (a larger world has
  the smaller one-shot limit, so an unmeasured world gets the more conservative neighbour);
- row bytes: at or outside the first/last point, that point; between two points, each limit is
  interpolated linearly in log(row bytes) -> log(limit) when both points hold a finite, positive
  limit, else taken from the nearer point (in log(row bytes); a tie takes the smaller row).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

__all__ = ["Limits", "CrossoverTable", "table", "TABLE_PATH"]

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crossovers.json")


@dataclasses.dataclass(frozen=True)
class Limits:
    """Largest messages (bytes per rank) for the one-shot (0: never), the flag-based two-shot (None:
    no limit) and the pipelined Lamport two-shot (0: never, None: no limit) kernels."""

    oneshot_max: int
    twoshot_max: int | None
    lamport_max: int | None = 0


@dataclasses.dataclass(frozen=True)
class _Point:
    row_bytes: int
    limits: Limits


def _between(lo: _Point, hi: _Point, row_bytes: int, pick) -> int | None:
    a, b = pick(lo.limits), pick(hi.limits)
    t = (math.log(row_bytes) - math.log(lo.row_bytes)) / (math.log(hi.row_bytes) - math.log(lo.row_bytes))
    if a is None or b is None or a <= 0 or b <= 0:
        return a if t <= 0.5 else b
    return int(round(math.exp(math.log(a) + t * (math.log(b) - math.log(a)))))


class CrossoverTable:
    """The crossover points of one machine kind (see the module docstring for the lookup rules)."""

    def __init__(self, worlds: dict[int, list[_Point]], source: str = ""):
        if not worlds:
            raise ValueError(f"crossover table {source or '(unnamed)'}: no world sizes")
        self.worlds = {w: sorted(points, key=lambda p: p.row_bytes) for w, points in sorted(worlds.items())}
        self.source = source

    @classmethod
    def from_dict(cls, data: dict, source: str = "") -> "CrossoverTable":
        """Parse the JSON form (``{"worlds": {"2": [{"row_bytes", "oneshot_max", "twoshot_max"}, ...]}}``),
        rejecting malformed entries with the file and the entry named."""
        where = source or "crossover table"
        worlds: dict[int, list[_Point]] = {}
        for key, entries in data.get("worlds", {}).items():
            try:
                world = int(key)
            except ValueError:
                raise ValueError(f"{where}: world key {key!r} is not an integer") from None
            if world < 2 or not entries:
                raise ValueError(f"{where}: world {key} needs world >= 2 and at least one point")
            points = []
            for i, entry in enumerate(entries):
                row, one, two = entry.get("row_bytes"), entry.get("oneshot_max"), entry.get("twoshot_max", None)
                lamport = entry.get("lamport_max", 0)
                at = f"{where}: world {key} point {i}"
                if not isinstance(row, int) or row <= 0:
                    raise ValueError(f"{at}: row_bytes must be a positive integer, got {row!r}")
                if not isinstance(one, int) or one < 0:
                    raise ValueError(f"{at}: oneshot_max must be an integer >= 0, got {one!r}")
                if two is not None and (not isinstance(two, int) or two <= 0):
                    raise ValueError(f"{at}: twoshot_max must be a positive integer or null (no limit), got {two!r}")
                if lamport is not None and (not isinstance(lamport, int) or lamport < 0):
                    raise ValueError(f"{at}: lamport_max must be an integer >= 0 or null (no limit), got {lamport!r}")
                points.append(_Point(row, Limits(one, two, lamport)))
            rows = [p.row_bytes for p in points]
            if len(set(rows)) != len(rows):
                raise ValueError(f"{where}: world {key} lists a row size twice: {sorted(rows)}")
            worlds[world] = points
        return cls(worlds, source)

    @classmethod
    def load(cls, path: str) -> "CrossoverTable":
        with open(path) as handle:
            return cls.from_dict(json.load(handle), source=path)

    def world_for(self, world: int) -> int:
        """The listed world size whose points serve ``world``."""
        larger = [w for w in self.worlds if w >= world]
        return min(larger) if larger else max(self.worlds)

    def limits(self, world: int, row_bytes: int) -> Limits:
        """The one-shot and two-shot limits for a group of ``world`` ranks and rows of ``row_bytes``."""
        points = self.worlds[self.world_for(world)]
        if row_bytes <= points[0].row_bytes:
            return points[0].limits
        if row_bytes >= points[-1].row_bytes:
            return points[-1].limits
        hi = next(i for i, p in enumerate(points) if p.row_bytes > row_bytes)
        lo = points[hi - 1]
        if lo.row_bytes == row_bytes:
            return lo.limits
        return Limits(_between(lo, points[hi], row_bytes, lambda lim: lim.oneshot_max),
                      _between(lo, points[hi], row_bytes, lambda lim: lim.twoshot_max),
                      _between(lo, points[hi], row_bytes, lambda lim: lim.lamport_max))


@functools.lru_cache(maxsize=None)
def table() -> CrossoverTable:
    """The packaged table (read once)."""
    return CrossoverTable.load(TABLE_PATH)
