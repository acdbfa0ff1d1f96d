"""All-reduce + residual add + RMSNorm: opfuse's kernels against NCCL, torch.compile and torch
symmetric memory, in one run (ratios are only meaningful within a run).

    PYTHONPATH=. python3 bench/allreduce_norm.py --world 2 4 [--json FILE] [--plot FILE.png]
    python3 bench/allreduce_norm.py --from-json FILE --plot FILE.png   # redraw, no GPU needed

Method (as ../shared/ANCHORS.md): CUDA-graph replays of 40 back-to-back calls, median of 7
replays, max over ranks; bf16; hidden 8192; inputs reset (untimed) before each replay so in-place
baselines stay finite. Columns:
  nccl_ar        NCCL all-reduce alone (in place)
  nccl_eager     NCCL all-reduce + eager ``x + res`` + ``F.rms_norm``
  nccl_compiled  NCCL all-reduce + the add+norm under torch.compile (one Triton kernel)
  symm1_eager    torch symm_mem one_shot_all_reduce + eager add+norm
  symm2_ar       torch symm_mem two_shot_all_reduce_ alone
  ours           opfuse AllReduceAddRMSNorm, implementation chosen by the dispatch table
  ours_1shot / ours_2shot / ours_nccl   the same with the implementation forced (where capable;
                            nccl = NCCL all-reduce + opfuse's local add+norm kernel)
  ours_ar        opfuse plain AllReduce (implementation chosen by the dispatch table)
  addnorm_*      single-GPU add+RMSNorm: opfuse kernel / eager / compiled (rank 0)
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import opfuse  # noqa: E402
from opfuse import ops  # noqa: E402
import common  # noqa: E402  (bench/common.py)
from timing import graph_replay_us, median  # noqa: E402  (bench/timing.py)

CALLS, REPLAYS, EPS = 40, 7, 1e-6


def graph_time_us(fn, reset=None) -> float:
    """Median over REPLAYS of a CUDA graph holding CALLS calls of ``fn``, per call (microseconds),
    max over ranks."""
    value = torch.tensor([median(graph_replay_us(fn, CALLS, REPLAYS, reset=reset))], device="cuda")
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def rms_block(hidden, dtype, reduce=True):
    return ops.Sequential(*([ops.AllReduce()] if reduce else []), ops.AddExtraInput(), ops.MakeExtraOutput(),
                          ops.RMSNorm(hidden, eps=EPS, dtype=dtype, device="cuda"))


def worker(rank, world, opts, out_path):
    from torch.distributed import _symmetric_memory as symm_mem

    torch.manual_seed(1234 + rank)
    dtype = getattr(torch, opts["dtype"])
    group_name = dist.group.WORLD.group_name
    rows = []
    compiled_add_norm = torch.compile(lambda a, r, w: F.rms_norm(a + r, (a.shape[-1],), w, EPS), dynamic=True)
    for hidden in opts["hidden"]:
        weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
        for tokens in opts["tokens"]:
            x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
            res = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
            buf = torch.empty_like(x)
            symm = symm_mem.empty(tokens, hidden, dtype=dtype, device="cuda")
            symm_mem.rendezvous(symm, group_name)
            reset_buf = lambda: buf.copy_(x)  # noqa: E731
            reset_symm = lambda: symm.copy_(x)  # noqa: E731
            row = {"hidden": hidden, "tokens": tokens, "bytes": x.numel() * x.element_size()}

            def nccl_eager():
                dist.all_reduce(buf)
                F.rms_norm(buf + res, (hidden,), weight, EPS)

            def nccl_compiled():
                dist.all_reduce(buf)
                compiled_add_norm(buf, res, weight)

            def symm1_eager():
                out = torch.ops.symm_mem.one_shot_all_reduce(symm, "sum", group_name)
                F.rms_norm(out + res, (hidden,), weight, EPS)

            row["nccl_ar"] = graph_time_us(lambda: dist.all_reduce(buf), reset_buf)
            row["nccl_eager"] = graph_time_us(nccl_eager, reset_buf)
            row["nccl_compiled"] = graph_time_us(nccl_compiled, reset_buf)
            row["symm1_eager"] = graph_time_us(symm1_eager, reset_symm)
            row["symm2_ar"] = graph_time_us(lambda: torch.ops.symm_mem.two_shot_all_reduce_(symm, "sum", group_name),
                                            reset_symm)
            with torch.no_grad():
                block = rms_block(hidden, dtype)
                with torch.no_grad():
                    block[-1].weight.copy_(weight)
                block(x, res)
                row["ours_impl"] = opfuse.compile(block, x, res).fusions[0].impl
                row["ours"] = graph_time_us(lambda: block(x, res))
                for impl, key in (("cuda_oneshot", "ours_1shot"), ("cuda_twoshot", "ours_2shot"),
                                  ("nccl+cuda", "ours_nccl")):
                    try:
                        # Forced one-shot / two-shot run past their automatic limits, to locate the
                        # crossovers. The timing stays inside the override: programs are cached per
                        # settings.
                        with opfuse.config.override(force_impl=f"allreduce_add_rmsnorm={impl}",
                                                    oneshot_max_bytes=32 << 20, twoshot_max_bytes=256 << 20):
                            forced = rms_block(hidden, dtype)
                            forced(x, res)
                            assert opfuse.compile(forced, x, res).fusions[0].impl == impl
                            row[key] = graph_time_us(lambda: forced(x, res))
                    except Exception as error:  # noqa: BLE001 - not capable at this size
                        row[key] = None
                        row[key + "_why"] = str(error).splitlines()[0][:120]
                plain = ops.Sequential(ops.AllReduce())
                plain(x)
                row["ours_ar_impl"] = opfuse.compile(plain, x).fusions[0].impl
                row["ours_ar"] = graph_time_us(lambda: plain(x))
                local = rms_block(hidden, dtype, reduce=False)
                local(x, res)
                row["addnorm_ours"] = graph_time_us(lambda: local(x, res))
                row["addnorm_eager"] = graph_time_us(lambda: F.rms_norm(x + res, (hidden,), weight, EPS))
                row["addnorm_compiled"] = graph_time_us(lambda: compiled_add_norm(x, res, weight))
            rows.append(row)
            if rank == 0:
                common.progress(f"world {world}: hidden {hidden}, {tokens} tokens done")
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(rows, handle)


def fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def table(world, rows) -> str:
    lines = [f"\nworld {world}, {rows[0]['hidden'] if rows else ''} hidden, bf16, microseconds per call "
             f"(CUDA graph of {CALLS} calls, median of {REPLAYS}, max over ranks)",
             "| tokens | bytes | NCCL AR | NCCL+eager | NCCL+compiled | symm1+eager | symm2 AR | ours | impl | "
             "ours/compiled | ours/symm1 | ours/symm2 | ours 1shot | ours 2shot | ours nccl | AR ours | AR ours/NCCL | "
             "add+norm ours/compiled |",
             "|" + "---|" * 18]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['bytes'] >> 10} KiB | {fmt(r['nccl_ar'])} | {fmt(r['nccl_eager'])} | "
            f"{fmt(r['nccl_compiled'])} | {fmt(r['symm1_eager'])} | {fmt(r['symm2_ar'])} | {fmt(r['ours'])} | "
            f"{r['ours_impl']} | {r['ours'] / r['nccl_compiled']:.2f} | {r['ours'] / r['symm1_eager']:.2f} | "
            f"{r['ours'] / r['symm2_ar']:.2f} | {fmt(r.get('ours_1shot'))} | {fmt(r.get('ours_2shot'))} | "
            f"{fmt(r.get('ours_nccl'))} | "
            f"{fmt(r['ours_ar'])} | {r['ours_ar'] / r['nccl_ar']:.2f} | "
            f"{r['addnorm_ours'] / r['addnorm_compiled']:.2f} ({fmt(r['addnorm_ours'])}/{fmt(r['addnorm_compiled'])}) |")
    return "\n".join(lines)


def ratio_series(results) -> dict:
    """The chart: opfuse / (NCCL + compiled add+norm) per world and hidden size, against tokens."""
    series = {}
    for world, rows in results.items():
        for r in rows:
            label = f"world {world}, hidden {r['hidden']}: opfuse / NCCL+compiled"
            series.setdefault(label, []).append((r["tokens"], r["ours"] / r["nccl_compiled"]))
    return series


def main() -> int:
    parser = common.parser("allreduce_norm", __doc__)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hidden", type=int, nargs="+", default=[8192])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512, 2048, 8192])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()

    def measure():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        measured = {}
        for world in common.worlds(args.world):
            common.progress(f"world {world}: {len(args.hidden) * len(args.tokens)} cases")
            opts = {"hidden": args.hidden, "tokens": args.tokens, "dtype": args.dtype}
            measured[str(world)] = common.run_ranks(worker, world, opts)
        return measured

    results = common.results(args, "allreduce_norm", min(args.world), measure)
    if results is None:
        return 0
    for world, rows in results.items():
        print(table(world, rows), flush=True)
    common.finish(args, results, series=ratio_series(results), xlabel="tokens",
                  ylabel="time ratio (< 1: opfuse faster)",
                  title="all-reduce + bias + residual + RMSNorm: opfuse / (NCCL all-reduce + compiled add+norm)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
