"""Measure every capable ``grouped_linear`` implementation per size class on this GPU and print the
tuning-table entries for it (``ORDER`` and ``PERSISTENT_TILES`` in
opfuse/families/grouped_linear/tuning.py), so one run per GPU kind produces its rows.

    PYTHONPATH=. python3 bench/grouped_tune.py [--reps 7] [--calls 4] [--classes decode large_m] [--json FILE]

Per size class, two MoE shapes (32 experts; up-projection K=7168 -> N=2048 and down-projection
K=2048 -> N=7168; decode 256 tokens, small-M 2048, large-M 32768), bf16, random uneven routing:

1. ``triton_persistent``: every candidate tile configuration (its default and
   ``persistent.CANDIDATES``) is checked against the reference and timed (forward, both shapes
   summed); the fastest becomes the class's ``PERSISTENT_TILES`` entry and is used below.
2. Forward: every capable implementation (checked against the reference, then timed) ranked by
   total time: the class's ``ORDER`` entry.
3. Forward + backward (dx and dW; small-M and large-M): the ``<class>+train`` entry.

Timing: CUDA events around ``--calls`` back-to-back calls, median of ``--reps``, the candidates
timed round-robin within each rep (bench/timing.py), inputs rotating over two sets (different data
and routing) so no call finds the previous one's operands in L2. The GPU is warmed up first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (bench/common.py)
from opfuse.core import dispatch as implementations  # noqa: E402
from opfuse.families.grouped_linear import persistent, tuning  # noqa: E402
from opfuse.families.grouped_linear.reference import reference_forward  # noqa: E402
from opfuse.machinery.implementation import CallSpec  # noqa: E402
from opfuse.ops.base import TensorMeta  # noqa: E402
from timing import interleaved_us, warm_up_gpu  # noqa: E402  (bench/timing.py)

OP = "grouped_linear"
DEV = "cuda"
DTYPE = torch.bfloat16
EXPERTS = 32
SHAPES = {  # size class -> [(tokens, K, N)]
    "decode": [(256, 7168, 2048), (256, 2048, 7168)],
    "small_m": [(2048, 7168, 2048), (2048, 2048, 7168)],
    "large_m": [(32768, 7168, 2048), (32768, 2048, 7168)],
}
TRAINED = ("small_m", "large_m")
ROTATE = 2
TOL = 2e-2          # bf16 outputs against the float32 reference, norm-wise


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor
    counts: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor


def make_inputs(tokens: int, k: int, n: int, seed: int) -> list[Inputs]:
    """``ROTATE`` sets of operands with different data and routing."""
    sets = []
    for r in range(ROTATE):
        gen = torch.Generator().manual_seed(seed * 131 + r)
        choice = torch.randint(0, EXPERTS, (tokens,), generator=gen)
        counts = torch.bincount(choice, minlength=EXPERTS).to(torch.int32).to(DEV)
        dgen = torch.Generator(device=DEV).manual_seed(seed * 131 + r)
        x = torch.randn(tokens, k, device=DEV, dtype=DTYPE, generator=dgen)
        w = torch.randn(EXPERTS, n, k, device=DEV, dtype=DTYPE, generator=dgen) / math.sqrt(k)
        dy = torch.randn(tokens, n, device=DEV, dtype=DTYPE, generator=dgen)
        sets.append(Inputs(x, counts, w, dy))
    return sets


def call_spec(inp: Inputs, training: bool) -> CallSpec:
    return CallSpec(OP, {"x": TensorMeta.of(inp.x), "group_sizes": TensorMeta.of(inp.counts),
                         "weight": TensorMeta.of(inp.w), "bias": None}, {"fsdp": False}, requires_grad=training)


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def correct(label: str, forward, inp: Inputs) -> bool:
    """Run ``forward(inp)`` once against the float32 reference; report and refuse a mismatch or an
    error (a candidate that fails to compile is left out, not fatal)."""
    try:
        got = forward(inp)
        err = rel(got, reference_forward(inp.x, inp.counts, inp.w, None))
    except Exception as error:  # noqa: BLE001 - one candidate's failure is a line of the report
        text = str(error).strip()
        print(f"    {label}: FAILED to run: {text.splitlines()[0][:160] if text else type(error).__name__}")
        return False
    if not err <= TOL:
        print(f"    {label}: WRONG (rel. error {err:.2e} > {TOL})")
        return False
    return True


def total_us(fns_per_shape: list[dict], args) -> dict[str, float]:
    """Sum over the shapes of each candidate's median time."""
    totals: dict[str, float] = {}
    for fns in fns_per_shape:
        for name, us in interleaved_us(fns, args.reps, args.calls).items():
            totals[name] = totals.get(name, 0.0) + us
    return totals


def rotating(fn, sets):
    return lambda i: fn(sets[i % len(sets)])


def tune_tiles(cls: str, shape_sets: list[list[Inputs]], args) -> tuple[tuning.Tiles | None, dict]:
    options = [persistent.default_tiles(cls), *persistent.CANDIDATES[cls]]
    reason = implementations.get(OP, persistent.NAME).check(call_spec(shape_sets[0][0], False))
    if reason:
        print(f"  {persistent.NAME} not capable: {reason}")
        return None, {}
    fns_per_shape = []
    good = set(range(len(options)))
    for sets in shape_sets:
        for i, tiles in enumerate(options):
            if i in good and not correct(tile_text(tiles), lambda inp, t=tiles: forward_with(inp, t), sets[0]):
                good.discard(i)
    for sets in shape_sets:
        fns_per_shape.append({str(i): rotating(lambda inp, t=options[i]: forward_with(inp, t), sets)
                              for i in sorted(good)})
    if not good:
        return None, {}
    times = total_us(fns_per_shape, args)
    best = options[int(min(times, key=times.get))]
    return best, {tile_text(options[int(i)]): us for i, us in times.items()}


def forward_with(inp: Inputs, tiles: tuning.Tiles):
    return persistent.grouped_mm_persistent(inp.x, inp.counts, inp.w, nk=True, config=tiles)


def rank_implementations(cls: str, shape_sets: list[list[Inputs]], training: bool, args) -> dict[str, float]:
    names = [name for name in implementations.names()[OP] if name != "reference"]
    entries = {}
    for name in names:
        entry = implementations.get(OP, name)
        reason = entry.check(call_spec(shape_sets[0][0], training))
        if reason:
            print(f"    {name}: not capable ({reason})")
            continue
        if all(correct(name, lambda inp, e=entry: e.forward(inp.x, inp.counts, inp.w, None), sets[0])
               for sets in shape_sets):
            entries[name] = entry

    def forward(entry):
        return lambda inp: entry.forward(inp.x, inp.counts, inp.w, None)

    def train(entry):
        def run(inp):
            entry.forward(inp.x, inp.counts, inp.w, None)
            entry.backward(inp.dy, inp.x, inp.counts, inp.w, need_dx=True, need_dw=True, need_db=False)
        return run

    make = train if training else forward
    fns_per_shape = [{name: rotating(make(entry), sets) for name, entry in entries.items()} for sets in shape_sets]
    return total_us(fns_per_shape, args) if entries else {}


def tile_text(t: tuning.Tiles) -> str:
    extra = "".join(f", {f.name}={getattr(t, f.name)!r}" for f in dataclasses.fields(t)[5:]
                    if getattr(t, f.name) != f.default)
    return f"Tiles({t.bm}, {t.bn}, {t.bk}, num_warps={t.num_warps}, num_stages={t.num_stages}{extra})"


def print_times(title: str, times: dict[str, float]) -> None:
    if not times:
        print(f"  {title}: nothing capable")
        return
    best = min(times.values())
    print(f"  {title}:")
    for name, us in sorted(times.items(), key=lambda kv: kv[1]):
        print(f"    {name:60s} {us:10.1f} us  {us / best:5.2f}x of best")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--classes", nargs="+", default=list(tuning.SIZE_CLASSES), choices=tuning.SIZE_CLASSES)
    parser.add_argument("--json", help="also write the entries and times to this file")
    args = parser.parse_args(argv)
    if common.skip_without_gpus("grouped_tune", 1):
        return 0
    import triton

    begin = time.perf_counter()
    device = torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}")
    warm_up_gpu()
    order: dict[str, tuple[str, ...]] = {}
    tiles: dict[str, tuning.Tiles] = {}
    times: dict[str, dict] = {}
    for cls in args.classes:
        print(f"\n{cls}: {EXPERTS} experts, (tokens, K, N) = {SHAPES[cls]}")
        shape_sets = [make_inputs(t, k, n, seed=t + k) for t, k, n in SHAPES[cls]]
        assert all(tuning.size_class(t, EXPERTS, k, n) == cls for t, k, n in SHAPES[cls])
        best, tile_times = tune_tiles(cls, shape_sets, args)
        print_times("triton_persistent tiles (forward, both shapes)", tile_times)
        if best is not None:
            tiles[cls] = best
            # The implementation-level calls below read the table: give them this run's tiles.
            tuning.PERSISTENT_TILES = {**tuning.PERSISTENT_TILES,
                                       device: {**tuning.PERSISTENT_TILES.get(device, {}), cls: best}}
        for training in ((False, True) if cls in TRAINED else (False,)):
            key = tuning.class_key(cls, training)
            ranked = rank_implementations(cls, shape_sets, training, args)
            print_times(f"{'forward + backward' if training else 'forward'} ({key})", ranked)
            times[key] = ranked
            if ranked:
                order[key] = tuple(sorted(ranked, key=ranked.get))
        del shape_sets
        torch.cuda.empty_cache()
        common.progress(f"{cls} done")

    print("\n=== tuning-table entries for this GPU (paste into opfuse/families/grouped_linear/tuning.py)")
    print("ORDER:")
    print(f"    {device!r}: {{")
    for key, names in order.items():
        print(f"        {key!r}: {names!r},")
    print("    },")
    print("PERSISTENT_TILES:")
    print(f"    {device!r}: {{")
    for cls, t in tiles.items():
        print(f"        {cls!r}: {tile_text(t)},")
    print("    },")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "triton": triton.__version__,
                       "order": order, "tiles": {c: dataclasses.asdict(t) for c, t in tiles.items()},
                       "times_us": times}, f, indent=1)
    print("\nsummary: fastest first per class (us, both shapes; ratio to the table order's first capable)")
    for key, ranked in times.items():
        if not ranked:
            continue
        first = next((n for n in implementations.names()[OP] if n in ranked), None)
        best = min(ranked, key=ranked.get)
        print(f"  {key:15s} best {best:18s} {ranked[best]:10.1f} us   table order would take {first} "
              f"({ranked[first] / ranked[best]:.2f}x)")
    print(f"(total {time.perf_counter() - begin:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
