"""Where a small all-reduce + add + RMSNorm call's time goes: the one-shot kernel's phase timeline.

    PYTHONPATH=. python3 bench/allreduce_timeline.py --world 2 --hidden 8192 --tokens 1 4 16 64 [--json F]
    PYTHONPATH=. python3 bench/allreduce_timeline.py --pdl on --push-packs 32 128 --poll-depth 1 2   # sweeps
    python3 bench/allreduce_timeline.py --from-json F      # print again, no GPU needed

Issue 30 asks where the 6-8 us of a 1-64 token call go. The one-shot kernel (cuda_oneshot, forced)
is captured in a CUDA graph of CALLS back-to-back calls, as bench/allreduce_norm.py times it, once
with its region's timeline set (``PeerRegion.set_timeline``: thread 0 of every block stores
%globaltimer at each phase boundary, row.cuh) and once without (the per-call time; the stamps
cost a few stores per block). Phases, per call, relative to the call's first block entry
(``entry``; with PDL the entry precedes the wait for the previous kernel):

  state    the call state read (after the PDL wait)     pushed   this block's pushes issued
  arrived  a row block's peer data in (thread 0's)        all in   every thread's (a barrier after
  row      its last row finished                                   ``arrived``, in timed launches only)
  end      the block's end                                next     the next call's first entry
  gap      next entry - this call's last block end

Each phase is shown as the earliest and the latest block (``a..b``), median over the calls of a
replay but the first (which follows the graph launch, not a previous call), mean over REPLAYS
replays;
``arrived`` and ``row`` count only blocks that own a row. %globaltimer is the GPU's own clock
(nanoseconds; its update step may be coarser, the means over calls smooth it); ranks' clocks are
not compared.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import opfuse  # noqa: E402
from opfuse import ops  # noqa: E402
import common  # noqa: E402  (bench/common.py)
import timing  # noqa: E402  (bench/timing.py)
from timing import graph_replay_us, median  # noqa: E402

CALLS, REPLAYS, EPS = 40, 5, 1e-6
PHASES = ("entry", "state", "pushed", "arrived", "row", "end", "all in", "summed", "reduced")  # OneShotPhase order


def phase_table(stamps) -> dict:
    """Per-phase medians over calls (microseconds) from one replay's stamps ``[calls, blocks, phases]`` (int64
    nanoseconds, 0 = not written): ``{phase: (earliest block, latest block)}`` relative to each
    call's first entry, plus ``next`` (entry to the next call's entry) and ``gap`` (the next
    call's first entry minus this call's last block end), the first call of the replay left out."""
    calls = []
    for ring in stamps.tolist():
        blocks = [row for row in ring if row[0] > 0]
        if blocks:
            calls.append(blocks)
    calls.sort(key=lambda blocks: min(b[0] for b in blocks))
    sums: dict[str, list[float]] = {}
    for index, blocks in enumerate(calls):
        if index == 0:
            continue
        t0 = min(b[0] for b in blocks)
        for p, name in enumerate(PHASES[1:], start=1):
            values = [b[p] - t0 for b in blocks if p < len(b) and b[p] > 0]  # records of older builds have fewer phases
            if values:
                sums.setdefault(name, []).append((min(values), max(values)))
        previous = calls[index - 1]
        prev_t0 = min(b[0] for b in previous)
        sums.setdefault("next", []).append((t0 - prev_t0,) * 2)
        sums.setdefault("gap", []).append((t0 - max(b[PHASES.index("end")] for b in previous),) * 2)
    return {name: (median([a for a, _ in v]) / 1e3, median([b for _, b in v]) / 1e3) for name, v in sums.items()}


def mean_tables(tables: list[dict]) -> dict:
    names = {name for t in tables for name in t}
    return {name: tuple(sum(t[name][k] for t in tables if name in t) / sum(name in t for t in tables)
                        for k in (0, 1)) for name in names}


def worker(rank, world, opts, out_path):
    import json

    from opfuse.families.residual_norm import cuda as residual_norm_cuda
    from opfuse.runtime import extension

    ext = extension.load("residual_norm")
    torch.manual_seed(1234 + rank)
    shared = torch.Generator(device="cuda").manual_seed(4321)
    dtype = torch.bfloat16
    rows = []
    for hidden in opts["hidden"]:
        for tokens in opts["tokens"]:
            for pdl in opts["pdl"]:
                x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
                res = torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=shared)
                with opfuse.config.override(force_impl="allreduce_add_rmsnorm=cuda_oneshot", pdl=pdl):
                    block = ops.Sequential(ops.AllReduce(), ops.AddExtraInput(), ops.MakeExtraOutput(),
                                           ops.RMSNorm(hidden, eps=EPS, dtype=dtype, device="cuda"))
                    block(x, res)
                    key = (dist.group.WORLD.group_name, x.device.index, "oneshot", dtype,
                           residual_norm_cuda._capacity("oneshot", x.nbytes))
                    region = residual_norm_cuda._plans[key].peer_region
                    plain_us = median(graph_replay_us(lambda: block(x, res), CALLS, REPLAYS))
                    stamps = torch.zeros(ext.TIMELINE_CALLS, ext.CALL_SLOTS, ext.TIMELINE_PHASES,
                                         dtype=torch.int64, device="cuda")
                    region.set_timeline(stamps.data_ptr())  # captured into the graph's kernel parameters
                    try:
                        graph = timing._capture(lambda: block(x, res), CALLS, 1)
                        tables, stamped = [], []
                        for _ in range(REPLAYS):
                            stamped.append(timing._replay_us(graph, CALLS, reset=stamps.zero_))
                            tables.append(phase_table(stamps.cpu()))
                        stamped_us = median(stamped)
                        del graph
                    finally:
                        region.set_timeline(0)
                rows.append({"hidden": hidden, "tokens": tokens, "pdl": pdl, "rank": rank, "us": plain_us,
                             "stamped_us": stamped_us, "phases": mean_tables(tables)})
                common.progress(f"rank {rank}: hidden {hidden}, {tokens} tokens, pdl {pdl}: {plain_us:.1f} us")
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump([row for ranks in gathered for row in ranks], handle)


def table(rows) -> str:
    names = ("state", "pushed", "arrived", "all in", "summed", "reduced", "row", "end", "next", "gap")
    lines = ["one-shot phase timeline, us from the call's first block entry (earliest..latest block)",
             f"{'hidden':>6} {'tok':>4} {'pdl':>3} {'push':>4} {'poll':>4} {'rank':>4} {'us/call':>7} {'stamped':>7}  "
             + "  ".join(f"{n:>11}" for n in names)]
    for r in sorted(rows, key=lambda r: (r["hidden"], r["tokens"], r["pdl"], r.get("push_packs", 0),
                                         r.get("poll_depth", 0), r["rank"])):
        cells = []
        for n in names:
            lo, hi = r["phases"].get(n, (float("nan"),) * 2)
            cells.append(f"{lo:5.2f}..{hi:<5.2f}" if n not in ("next", "gap") else f"{lo:11.2f}")
        lines.append(f"{r['hidden']:>6} {r['tokens']:>4} {int(r['pdl']):>3} {r.get('push_packs', 0) or '-':>4} "
                     f"{r.get('poll_depth', 0) or '-':>4} "
                     f"{r['rank']:>4} {r['us']:7.2f} "
                     f"{r['stamped_us']:7.2f}  " + "  ".join(cells))
    return "\n".join(lines)


def main() -> int:
    parser = common.parser("allreduce_timeline", __doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, nargs="+", default=[8192])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--pdl", choices=["off", "on", "both"], default="both")
    parser.add_argument("--poll-depth", type=int, nargs="+", default=[0], metavar="D",
                        help="loads in flight per waiting pack (OPFUSE_ONESHOT_POLL_DEPTH: 1 or 2; one set of ranks "
                             "per value); 0: the kernel's default")
    parser.add_argument("--push-packs", type=int, nargs="+", default=[0], metavar="N",
                        help="16-byte packs each block pushes (OPFUSE_ONESHOT_PUSH_PACKS; one set of ranks "
                             "per value); 0: the kernel's default")
    args = parser.parse_args()
    pdl = {"off": [False], "on": [True], "both": [False, True]}[args.pdl]

    def measure():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        rows = []
        for packs in args.push_packs:  # both read once per process by the kernel's launcher
            for depth in args.poll_depth:
                for name, value in (("OPFUSE_ONESHOT_PUSH_PACKS", packs), ("OPFUSE_ONESHOT_POLL_DEPTH", depth)):
                    if value:
                        os.environ[name] = str(value)
                    else:
                        os.environ.pop(name, None)
                for row in common.run_ranks(worker, args.world,
                                            {"hidden": args.hidden, "tokens": args.tokens, "pdl": pdl}):
                    rows.append({**row, "push_packs": packs, "poll_depth": depth})
        return rows

    rows = common.results(args, "allreduce_timeline", args.world, measure)
    if rows is None:
        return 0
    print(table(rows), flush=True)
    common.finish(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
