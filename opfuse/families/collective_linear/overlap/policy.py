"""Sizing decisions of the overlap pipelines: how a rank's chunk is split into sub-chunks, which
signal channels a pipeline uses, and how many bytes of symmetric memory it needs. Pure Python:
the capability check, the plan builders and the CPU tests share it.

Why (the measurements behind each rule are in docs/PERF_NOTES.overlap.md):

* **GEMM size in waves.** cuBLAS tiles a GEMM's output in ~128 x 256 tiles, one per SM at a
  time, so a ``rows x cols`` GEMM takes ``ceil(waves)`` rounds (:func:`gemm_waves`). Chunking pays
  for every partial last round, and chunks under one wave re-read the whole weight. Hence: the
  all-gather GEMMs group small remote shards into GEMMs of >= :data:`MIN_GEMM_WAVES` waves
  (:func:`gather_group`; a group waits for its last shard, which lands within the own shard's
  GEMM at these sizes), and independent chunk GEMMs use a second stream only when a chunk's last
  round is at least :data:`ALTERNATE_MIN_TAIL` idle (:func:`alternate_gemms`); otherwise two
  GEMMs only share the SMs and the L2 for their whole length.
* **Two reduce-scatter schedules** (:func:`rs_algorithm`). ``ring``: partial sums travel rank to
  rank and are accumulated in the next rank's GEMM epilogue (no extra memory pass); a hop depends
  on the previous step of the next rank, so two row halves per chunk give each hop one sub-GEMM of
  slack; used when the halves keep >= :data:`MIN_ROWS_PER_ROW_SPLIT` rows, never on two streams.
  ``direct``: each rank GEMMs every peer's chunk whole and pushes it to its owner, which sums the
  early partials while its own GEMMs run and accumulates its own GEMM onto them; it keeps whole-
  chunk GEMMs where the ring's halves would fill only half a wave.
* **Host cost.** Every plan instruction is one call into torch in eager mode, so these rules never
  trade a few GPU microseconds for many more instructions.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["Grid", "ChannelMap", "channel_map", "ring_grid", "gather_grid", "rs_algorithm", "gather_region_bytes",
           "ring_region_bytes", "bias_region_bytes", "direct_region_bytes", "CHANNEL_BASE", "MIN_ROWS_PER_ROW_SPLIT",
           "gemm_waves", "alternate_gemms", "gather_group", "DEFAULT_SMS", "TILE_ROWS", "TILE_COLS",
           "MIN_GEMM_WAVES", "ALTERNATE_MIN_TAIL"]

#: Signal-pad channels below this are left to other users of the pool's handles (the lead's
#: kernels, torch); the overlap pipelines use ``CHANNEL_BASE`` and up.
CHANNEL_BASE = 8
#: A row split keeps at least this many rows per sub-GEMM (compute-bound on H100/H200 for
#: K >= 4096); smaller chunks are split along the output columns instead.
MIN_ROWS_PER_ROW_SPLIT = 512
#: Sub-chunks per ring chunk when the setting is "auto".
RING_SUBCHUNKS_AUTO = 2
#: SMs assumed when the device is unknown (H100 / H200 SXM).
DEFAULT_SMS = 132
#: Output tile of cuBLAS's large bf16 GEMMs on sm90 (rows x cols of the row-major output).
TILE_ROWS, TILE_COLS = 128, 256
#: A grouped all-gather GEMM covers at least this many waves (its last round is then <= 1/3 idle).
MIN_GEMM_WAVES = 2.0
#: Alternate GEMM streams when at least this fraction of a chunk GEMM's rounds is idle tail.
ALTERNATE_MIN_TAIL = 0.10

@dataclasses.dataclass(frozen=True)
class Grid:
    """A chunk of ``rows x cols`` cut into ``row_parts x col_parts`` equal sub-chunks, numbered
    row-major. ``count == 1`` means the chunk is not split."""

    rows: int
    cols: int
    row_parts: int = 1
    col_parts: int = 1

    def __post_init__(self):
        if self.row_parts < 1 or self.col_parts < 1:
            raise ValueError(f"Grid: parts must be >= 1 (got {self.row_parts} x {self.col_parts})")
        if self.rows % self.row_parts or self.cols % self.col_parts:
            raise ValueError(f"Grid: {self.rows} x {self.cols} does not split evenly into "
                             f"{self.row_parts} x {self.col_parts}")

    @property
    def count(self) -> int:
        return self.row_parts * self.col_parts

    @property
    def sub_rows(self) -> int:
        return self.rows // self.row_parts

    @property
    def sub_cols(self) -> int:
        return self.cols // self.col_parts

    @property
    def sub_elems(self) -> int:
        return self.sub_rows * self.sub_cols

    def sub(self, j: int) -> tuple[int, int, int, int]:
        """``(row0, rows, col0, cols)`` of sub-chunk ``j`` inside the chunk."""
        if not 0 <= j < self.count:
            raise IndexError(f"Grid: sub-chunk {j} of {self.count}")
        jr, jc = divmod(j, self.col_parts)
        return jr * self.sub_rows, self.sub_rows, jc * self.sub_cols, self.sub_cols


def _split(size: int, parts: int) -> bool:
    return parts >= 1 and size % parts == 0 and size // parts >= 1


def gemm_waves(rows: int, cols: int, sms: int = DEFAULT_SMS) -> float:
    """Output tiles of a ``rows x cols`` GEMM result per SM (:data:`TILE_ROWS` x :data:`TILE_COLS`)."""
    tiles = math.ceil(rows / TILE_ROWS) * math.ceil(cols / TILE_COLS)
    return tiles / max(1, sms)


def alternate_gemms(rows: int, cols: int, sms: int = DEFAULT_SMS, setting: str = "auto") -> bool:
    """Whether independent chunk GEMMs of ``rows x cols`` outputs should alternate between two
    streams: when the last round of one is at least :data:`ALTERNATE_MIN_TAIL` idle, so the next
    GEMM's first tiles fill it. ``setting`` (``config.overlap_alternate_streams``): ``"on"`` /
    ``"off"`` force it for every gather and direct schedule (the bench times both)."""
    if setting != "auto":
        return setting == "on"
    waves = gemm_waves(rows, cols, sms)
    rounds = math.ceil(waves)
    return (rounds - waves) / rounds >= ALTERNATE_MIN_TAIL


def gather_group(rows: int, cols: int, setting: int = 0, sms: int = DEFAULT_SMS) -> int:
    """Remote shards (``rows`` tokens each, ``cols`` outputs) per GEMM of the all-gather schedule:
    enough consecutive shards for :data:`MIN_GEMM_WAVES` waves (automatic setting only;
    ``OPFUSE_OVERLAP_CHUNKS >= 1`` keeps one GEMM per shard or sub-chunk)."""
    if setting != 0:
        return 1
    waves = gemm_waves(rows, cols, sms)
    return max(1, math.ceil(MIN_GEMM_WAVES / waves - 1e-9)) if waves > 0 else 1


def ring_grid(rows: int, cols: int, setting: int = 0) -> Grid:
    """Sub-chunk grid of one reduce-scatter ring chunk (``rows`` tokens x ``cols`` outputs).

    ``setting`` is ``config.overlap_chunks``: 0 = auto (2 sub-chunks), ``n`` = ``n`` sub-chunks.
    Rows are split when every part keeps >= :data:`MIN_ROWS_PER_ROW_SPLIT` rows, else columns;
    a count that divides neither falls back to fewer parts (1 at worst, which is correct but
    exposes every ring hop)."""
    want = RING_SUBCHUNKS_AUTO if setting == 0 else setting
    for parts in range(want, 0, -1):
        if _split(rows, parts) and rows // parts >= MIN_ROWS_PER_ROW_SPLIT:
            return Grid(rows, cols, parts, 1)
        if _split(cols, parts):
            return Grid(rows, cols, 1, parts)
        if _split(rows, parts):
            return Grid(rows, cols, parts, 1)
    return Grid(rows, cols)


def rs_algorithm(rows: int, cols: int, setting: int = 0) -> tuple[str, Grid]:
    """The reduce-scatter schedule for chunks of ``rows x cols``: ``("ring", grid)`` or
    ``("direct", unsplit grid)``. ``setting`` (``config.overlap_chunks``): 0 = auto (ring with
    two row halves when each keeps >= :data:`MIN_ROWS_PER_ROW_SPLIT` rows, else direct), 1 =
    direct, ``n >= 2`` = ring with ``n`` sub-chunks (:func:`ring_grid`; direct if ``n`` divides
    neither dimension)."""
    if setting == 0:
        if rows % 2 == 0 and rows // 2 >= MIN_ROWS_PER_ROW_SPLIT:
            return "ring", Grid(rows, cols, 2, 1)
        return "direct", Grid(rows, cols)
    if setting == 1:
        return "direct", Grid(rows, cols)
    grid = ring_grid(rows, cols, setting)
    return ("ring", grid) if grid.count > 1 else ("direct", Grid(rows, cols))


def gather_grid(rows: int, cols: int, setting: int = 0) -> Grid:
    """Sub-chunk grid of one all-gather shard: auto = 1 (the local GEMM hides the first
    transfer); ``setting = n`` splits the rows into the largest count <= n that divides them."""
    want = 1 if setting == 0 else setting
    for parts in range(want, 0, -1):
        if _split(rows, parts):
            return Grid(rows, cols, parts, 1)
    return Grid(rows, cols)


@dataclasses.dataclass(frozen=True)
class ChannelMap:
    """Signal-pad channels of one pipeline call. Every (sender, receiver, channel) slot carries
    at most one signal per call, so no ``put_signal`` ever spins on a slot still set."""

    world: int
    gather_parts: int
    ring_items: int
    base: int = CHANNEL_BASE

    @property
    def barrier(self) -> int:
        return self.base

    @property
    def bias(self) -> int:
        """The owner's bias vector has landed in its symmetric slot (ring chain starts read it)."""
        return self.base + 1

    def gather(self, j: int) -> int:
        if not 0 <= j < self.gather_parts:
            raise IndexError(j)
        return self.base + 2 + j

    def ring(self, item: int) -> int:
        if not 0 <= item < self.ring_items:
            raise IndexError(item)
        return self.base + 2 + self.gather_parts + item

    @property
    def end(self) -> int:
        """One past the last channel used."""
        return self.base + 2 + self.gather_parts + self.ring_items

    @staticmethod
    def available(signal_pad_bytes: int, world: int) -> int:
        """Channels a signal pad of ``signal_pad_bytes`` offers at ``world`` ranks (torch's
        layout: one uint32 per (channel, peer))."""
        return signal_pad_bytes // 4 // world


def channel_map(world: int, gather: Grid | None, ring: Grid | None, *, direct: bool = False) -> ChannelMap:
    """Channels of a call that gathers with ``gather`` and/or reduce-scatters with a ring of
    ``ring`` sub-chunks, or directly (``direct``: one signal per sender)."""
    ring_items = 1 if direct else ((world - 1) * ring.count if ring else 0)
    return ChannelMap(world, gather.count if gather else 1, ring_items)


def gather_region_bytes(world: int, rows: int, cols: int, itemsize: int) -> int:
    """The gathered operand ``[world * rows, cols]`` (every rank's shard, rank order)."""
    return world * rows * cols * itemsize


def bias_region_bytes(cols: int, itemsize: int) -> int:
    """One bias vector per rank (read by the peer that starts the ring chain of this rank's chunk)."""
    return cols * itemsize


def direct_region_bytes(world: int, rows: int, cols: int, itemsize: int) -> int:
    """Every peer's partial sum of this rank's chunk: ``[(world - 1) * rows, cols]``."""
    return (world - 1) * rows * cols * itemsize


def ring_region_bytes(world: int, rows: int, cols: int, itemsize: int) -> int:
    """Receive slots of the ring: ``world - 1`` chunks of ``rows x cols`` (whatever the grid,
    since sub-chunks split a chunk evenly)."""
    return (world - 1) * rows * cols * itemsize
