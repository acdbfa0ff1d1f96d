"""Where the all-reduce + add + norm kernels hand over to each other, by world size and row size.

The implementations are tried in the order one-shot, pipelined Lamport two-shot, flag-based two-shot,
NCCL + the local kernel; a message (bytes per rank) goes to the first whose limit it does not
exceed. The limits come from
``crossovers.json`` next to this module, written by ``tools/crossover_table.py`` from a sweep of
``bench/allreduce_crossover.py`` (docs/PERF_NOTES.md). ``OPFUSE_ONESHOT_MAX_BYTES`` /
``OPFUSE_TWOSHOT_MAX_BYTES`` override them when non-zero (:mod:`.cuda`).

The table holds, per world size, points keyed by row bytes (hidden x element size), each with
``oneshot_max`` (bytes; 0: never one-shot), ``lamport_max`` (bytes; 0 or absent: never the Lamport
two-shot; null: no limit) and ``twoshot_max`` (bytes; null: no limit). Those top-level ``worlds``
are the default; ``gpus`` maps a GPU's name as the driver reports it (``NVIDIA H100 80GB HBM3``)
to worlds measured on that GPU, which replace the default's world by world. Lookup:

- GPU: the device's entry in ``gpus`` for the worlds it lists, the default for the others;
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
    """The crossover points: the default worlds and those measured per GPU kind (see the module
    docstring for the lookup rules)."""

    def __init__(self, worlds: dict[int, list[_Point]], source: str = "",
                 gpus: dict[str, dict[int, list[_Point]]] | None = None):
        if not worlds:
            raise ValueError(f"crossover table {source or '(unnamed)'}: no world sizes")
        self.worlds = {w: sorted(points, key=lambda p: p.row_bytes) for w, points in sorted(worlds.items())}
        self.source = source
        self.gpus = {name: {w: sorted(points, key=lambda p: p.row_bytes) for w, points in sorted(listed.items())}
                     for name, listed in (gpus or {}).items()}

    @classmethod
    def from_dict(cls, data: dict, source: str = "") -> "CrossoverTable":
        """Parse the JSON form (``{"worlds": {"2": [{"row_bytes", "oneshot_max", "twoshot_max"}, ...]},
        "gpus": {name: {"worlds": ...}}}``), rejecting malformed entries with the file and the entry
        named."""
        where = source or "crossover table"
        gpus = {}
        for name, entry in data.get("gpus", {}).items():
            if not isinstance(entry, dict) or not entry.get("worlds"):
                raise ValueError(f"{where}: gpus[{name!r}] needs a non-empty 'worlds'")
            gpus[name] = cls._worlds(entry["worlds"], f"{where}: gpus[{name!r}]")
        return cls(cls._worlds(data.get("worlds", {}), where), source, gpus)

    @staticmethod
    def _worlds(listed: dict, where: str) -> dict[int, list[_Point]]:
        worlds: dict[int, list[_Point]] = {}
        for key, entries in listed.items():
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
        return worlds

    @classmethod
    def load(cls, path: str) -> "CrossoverTable":
        with open(path) as handle:
            return cls.from_dict(json.load(handle), source=path)

    def worlds_of(self, gpu: str | None) -> dict[int, list[_Point]]:
        """The worlds that serve GPU ``gpu``: its own where measured, the default's elsewhere."""
        own = self.gpus.get(gpu) if gpu else None
        return self.worlds if not own else dict(sorted({**self.worlds, **own}.items()))

    def world_for(self, world: int, gpu: str | None = None) -> int:
        """The listed world size whose points serve ``world`` (on GPU ``gpu``)."""
        worlds = self.worlds_of(gpu)
        larger = [w for w in worlds if w >= world]
        return min(larger) if larger else max(worlds)

    def limits(self, world: int, row_bytes: int, gpu: str | None = None) -> Limits:
        """The one-shot, two-shot and Lamport limits for a group of ``world`` ranks and rows of
        ``row_bytes`` on GPU ``gpu`` (the driver's name; ``None``: the default)."""
        points = self.worlds_of(gpu)[self.world_for(world, gpu)]
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
