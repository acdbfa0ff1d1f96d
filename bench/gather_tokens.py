"""The token all-gather alone: NCCL's ``all_gather_into_tensor`` against opfuse's ``all_gather_tokens``
over peer memory (copy-engine pushes, then the copy-out of the gathered region), and the floor.

    PYTHONPATH=. python3 bench/gather_tokens.py --world 2 [--kib 256 1024 8192] [--json FILE]

bf16 shards of ``--kib`` KiB per rank (4096 columns); CUDA graphs of CALLS back-to-back gathers
per variant (no launch cost), replayed in turn (``graphs_replay_us``), median, slowest rank.
Floor: ``(world - 1) * shard`` over the peer egress measured at the start (the faster of NCCL and
the copy engines), plus the copy-out at the device-copy bandwidth measured at the start. The
``p2p / nccl`` column sets ``p2p.MIN_GATHER_BYTES``, below which NCCL keeps the gather.
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
from timing import device_copy_gbs, graphs_replay_us, max_over_ranks, median, peer_egress_gbs  # noqa: E402

CALLS, REPS, COLS = 10, 7, 4096


def worker(rank: int, world: int, kibs: list, out_path: str) -> None:
    torch.cuda.set_device(rank)
    from opfuse.families.collective_linear import p2p
    from opfuse.ops import group as groups
    from opfuse.runtime.symm_pool import open_pool

    if open_pool(dist.group.WORLD, torch.device("cuda", rank)) is None:
        raise RuntimeError("no symmetric pool on this host")
    name = groups.group_name(dist.group.WORLD)
    egress = peer_egress_gbs()["best"]
    hbm = device_copy_gbs()
    rows_out = []
    for kib in kibs:
        rows = max(1, (kib << 10) // (COLS * 2))
        shard = torch.randn(rows, COLS, device="cuda").to(torch.bfloat16)
        gathered = torch.empty(world * rows, COLS, device="cuda", dtype=torch.bfloat16)
        got = p2p.all_gather_tokens_forward(shard, name)  # binds the plan outside capture
        dist.all_gather_into_tensor(gathered, shard)
        ok = torch.equal(got, gathered)
        fns = {"nccl": lambda: dist.all_gather_into_tensor(gathered, shard),
               "p2p": lambda: p2p.all_gather_tokens_forward(shard, name)}
        times = graphs_replay_us(fns, CALLS, REPS)
        row = {"world": world, "KiB": kib, "ok": max_over_ranks(0.0 if ok else 1.0) == 0.0}
        for variant, values in times.items():
            row[variant] = max_over_ranks(median(values))
        nbytes = rows * COLS * 2
        row["floor"] = (world - 1) * nbytes / egress / 1e3 + 2 * world * nbytes / hbm / 1e3
        rows_out.append(row)
        if rank == 0:
            common.progress(f"world {world}: {kib} KiB done")
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(rows_out, handle)


def table(results) -> str:
    head = ["world", "KiB per rank", "nccl us", "p2p us", "floor us", "p2p / nccl", "p2p / floor", "bitwise equal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        lines.append(f"| {r['world']} | {r['KiB']} | {r['nccl']:.1f} | {r['p2p']:.1f} | {r['floor']:.1f} | "
                     f"{r['p2p'] / r['nccl']:.2f} | {r['p2p'] / r['floor']:.2f} | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def main() -> int:
    parser = common.parser("gather_tokens", __doc__)
    parser.add_argument("--world", type=int, nargs="+", default=[2])
    parser.add_argument("--kib", type=int, nargs="+", default=[64, 256, 1024, 4096, 8192, 16384])
    args = parser.parse_args()

    def measure():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        found = []
        for world in common.worlds(args.world):
            found += common.run_ranks(worker, world, args.kib, timeout=300)
        return found

    results = common.results(args, "gather_tokens", min(args.world), measure)
    if results is None:
        return 0
    print("Token all-gather alone, bf16 (us per gather, CUDA graphs; floor: egress + copy-out)")
    print(table(results), flush=True)
    common.finish(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
