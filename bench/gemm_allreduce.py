"""Row-parallel GEMM + all-reduce (+ residual add + RMSNorm): one GEMM then the collective, against the
GEMM split along tokens with each chunk's all-reduce (NCCL, asynchronous) running under the next
chunk's GEMM, in one run. Hidden 8192, bf16, the two row-parallel projections of the Llama-style
model of bench/model.py (attention output K = 8192/world, MLP down K = 28672/world).

    PYTHONPATH=. python3 bench/gemm_allreduce.py --world 2
    PYTHONPATH=. python3 bench/gemm_allreduce.py --world 2 --tokens 2048 8192 --chunks 2 4 8

Columns (microseconds per call, CUDA events around CALLS eager calls, round-robin over the
variants, median of REPS rounds, max over ranks): ``gemm`` the GEMM alone (the floor), ``ar`` NCCL's all-reduce alone, ``serial`` GEMM then
all-reduce then add + norm (what torch.compile runs), ``chunked C`` the pipeline with C chunks
(``torch.mm`` per chunk into the output, ``dist.all_reduce(async_op=True)`` per chunk, add + norm
when every chunk has arrived). ``best / serial`` < 1: the pipeline wins; ``best / gemm``: how
close it comes to hiding the collective entirely.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import common  # noqa: E402
import timing  # noqa: E402

HIDDEN = 8192
SHAPES = {"attention out": 8192, "mlp down": 28672}


def _norm(h, weight):
    return F.rms_norm(h, (h.shape[-1],), weight, 1e-5)


def serial(x, w, residual, weight, group):
    y = torch.mm(x, w.t())
    dist.all_reduce(y, group=group)
    h = y + residual
    return _norm(h, weight), h


def chunked(x, w, residual, weight, group, chunks: int):
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    works = []
    for part_x, part_y in zip(x.chunk(chunks), y.chunk(chunks)):
        torch.mm(part_x, w.t(), out=part_y)
        works.append(dist.all_reduce(part_y, group=group, async_op=True))
    for work in works:
        work.wait()
    h = y + residual
    return _norm(h, weight), h


def worker(rank, world, opts, out_path):
    import json

    torch.manual_seed(rank)
    rows = []
    timing.warm_up_gpu()
    group = dist.group.WORLD
    for name, inner in SHAPES.items():
        k = inner // world
        w = torch.randn(HIDDEN, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        weight = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
        for tokens in opts["tokens"]:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
            want = serial(x, w, residual, weight, group)
            fns = {"gemm": lambda: torch.mm(x, w.t(), out=y), "ar": lambda: dist.all_reduce(y, group=group),
                   "serial": lambda: serial(x, w, residual, weight, group)}
            errors = {}
            for c in opts["chunks"]:
                got = chunked(x, w, residual, weight, group, c)
                errors[c] = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                                for a, b in zip(got, want))
                fns[f"chunked {c}"] = lambda c=c: chunked(x, w, residual, weight, group, c)
            dist.barrier()
            times = timing.interleaved_us({key: (lambda i, fn=fn: fn()) for key, fn in fns.items()}, opts["reps"],
                                          opts["calls"])
            row = {"shape": name, "tokens": tokens, "err": max(errors.values())}
            row.update({key: timing.max_over_ranks(value) for key, value in times.items()})
            rows.append(row)
            if rank == 0:
                common.progress(f"{name} T={tokens}: done")
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(rows, handle)


def main() -> int:
    parser = common.parser("gemm_allreduce", __doc__)
    parser.add_argument("--world", type=int, nargs="+", default=[2])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    if common.skip_without_gpus("gemm_allreduce", min(args.world)):
        return 0
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    opts = {"tokens": args.tokens, "chunks": args.chunks, "calls": 5, "reps": 7}
    for world in common.worlds(args.world):
        rows = common.run_ranks(worker, world, opts)
        chunk_cols = [f"chunked {c}" for c in args.chunks]
        print(f"\nworld {world}, hidden {HIDDEN}, bf16, us per call (CUDA graphs, max over ranks)")
        print("| shape | tokens | gemm | ar | serial | " + " | ".join(chunk_cols) + " | best / serial | best / gemm |"
              " rel. error |")
        print("|" + "---|" * (8 + len(chunk_cols)))
        for r in rows:
            best = min(r[c] for c in chunk_cols)
            print(f"| {r['shape']} | {r['tokens']} | {r['gemm']:.1f} | {r['ar']:.1f} | {r['serial']:.1f} | "
                  + " | ".join(f"{r[c]:.1f}" for c in chunk_cols)
                  + f" | {best / r['serial']:.2f} | {best / r['gemm']:.2f} | {r['err']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
