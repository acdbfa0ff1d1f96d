"""Copy-engine push bandwidth into peers' symmetric memory: how the all-gather schedules of
:mod:`opfuse.families.collective_linear.overlap` should issue their pushes.

    PYTHONPATH=. python3 bench/push_bandwidth.py --world 2 4 [--json FILE] [--plot FILE.png]

Every rank pushes its shard (``--mib`` MiB each) into every peer's region at the same time, as
the all-gather + GEMM schedule does; CUDA graphs of CALLS pushes-of-everything (no launch cost),
median of REPS replays, max over ranks. Modes:

  1s     one stream, peers r-1, r-2, ... in turn (the schedule as of overlap v2)
  2s     two streams, peers alternating between them
  ps     one stream per peer (all pushes concurrent)
  nccl   ``all_gather_into_tensor`` of the same shard (reference)

``GB/s`` is one rank's egress: ``(world - 1) * shard / time``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (bench/common.py)
from opfuse.runtime.symm_pool import open_pool  # noqa: E402
from timing import graph_replay_us, max_over_ranks, median  # noqa: E402  (bench/timing.py)

CALLS, REPS = 10, 7
MODES = ("1s", "2s", "ps", "nccl")


def _pusher(mode: str, rank: int, world: int, shard: torch.Tensor, peers: list, streams: list):
    """``fn()`` pushing ``shard`` into block ``rank`` of every peer's region in ``mode``."""
    order = [(rank - i) % world for i in range(1, world)]
    lanes = {"1s": 1, "2s": 2, "ps": world - 1}[mode]
    rows = shard.shape[0]

    def fn():
        main = torch.cuda.current_stream()
        for s in streams[:lanes]:
            s.wait_stream(main)
        for i, dst in enumerate(order):
            with torch.cuda.stream(streams[i % lanes]):
                peers[dst][rank * rows:(rank + 1) * rows].copy_(shard)
        for s in streams[:lanes]:
            main.wait_stream(s)
    return fn


def worker(rank: int, world: int, mibs: list, out_path: str) -> None:
    torch.cuda.set_device(rank)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    pool = open_pool(dist.group.WORLD, torch.device("cuda", rank))
    if pool is None:
        raise RuntimeError("no symmetric pool on this host")
    cols = 4096
    streams = [torch.cuda.Stream(priority=-1) for _ in range(world - 1)]
    results = []
    for mib in mibs:
        rows = (mib << 20) // (cols * 2)
        region = pool.reserve(f"bench/push/{rows}", world * rows * cols * 2)
        if region is None:
            raise RuntimeError(f"pool has no room for {world * mib} MiB (raise OPFUSE_SYMM_POOL_MAX_MB)")
        peers = [region.peer_tensor(p, torch.bfloat16, (world * rows, cols)) for p in range(world)]
        shard = torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
        gathered = torch.empty(world * rows, cols, device="cuda", dtype=torch.bfloat16)
        row = {"world": world, "MiB": mib}
        for mode in MODES:
            if mode == "nccl":
                def fn():
                    dist.all_gather_into_tensor(gathered, shard)
            else:
                fn = _pusher(mode, rank, world, shard, peers, streams)
            us = max_over_ranks(median(graph_replay_us(fn, CALLS, REPS)))
            row[mode] = us
        # Correctness of what was timed: block p of this rank's region holds rank p's shard, as
        # NCCL's gather (timed last) does.
        torch.cuda.synchronize()
        dist.barrier()
        local = peers[rank]
        ok = all(torch.equal(local[p * rows:(p + 1) * rows], gathered[p * rows:(p + 1) * rows])
                 for p in range(world) if p != rank)
        row["ok"] = max_over_ranks(0.0 if ok else 1.0) == 0.0
        results.append(row)
        if rank == 0:
            common.progress(f"world {world}: {mib} MiB done")
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(results, handle)


def gbs(row, mode) -> float:
    """One rank's egress in GB/s: ``(world - 1) * shard / time``."""
    return (row["world"] - 1) * row["MiB"] * 2**20 / row[mode] / 1e3


def table(results) -> str:
    head = ["world", "MiB"] + [f"{m} us" for m in MODES] + [f"{m} GB/s" for m in MODES] + ["ok"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in results:
        cells = [str(row["world"]), str(row["MiB"])] + [f"{row[m]:.1f}" for m in MODES] + \
            [f"{gbs(row, m):.0f}" for m in MODES] + ["yes" if row["ok"] else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = common.parser("push_bandwidth", __doc__)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mib", type=int, nargs="+", default=[1, 4, 8, 32])
    args = parser.parse_args()

    def measure():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        rows = []
        for world in common.worlds(args.world):
            rows += common.run_ranks(worker, world, args.mib, timeout=600)
        return rows

    results = common.results(args, "push_bandwidth", min(args.world), measure)
    if results is None:
        return 0
    print(f"Push bandwidth, shard sizes {sorted({r['MiB'] for r in results})} MiB "
          f"(us per all-gather; GB/s = one rank's egress)")
    print(table(results), flush=True)
    series = {}
    for row in results:
        for mode in MODES[:-1]:  # every mode against the last one, NCCL
            series.setdefault(f"world {row['world']} {mode}: {mode} / nccl", []).append(
                (row["MiB"], row[mode] / row["nccl"]))
    common.finish(args, results, series=series, xlabel="shard MiB", ylabel="time ratio (1 = NCCL all-gather)",
                  title="copy-engine pushes into peers vs NCCL all-gather")
    return 0


if __name__ == "__main__":
    sys.exit(main())
