"""All-reduce + residual add + RMSNorm: opfuse's kernels against NCCL, torch.compile, torch
symmetric memory and FlashInfer's fused kernel, in one run (ratios are only meaningful within a run).

    PYTHONPATH=. python3 bench/allreduce_norm.py --world 2 4 [--json FILE] [--plot FILE.png]
    PYTHONPATH=. python3 bench/allreduce_norm.py --world 2 4 --hidden 8192 5120 --tokens 1 64 256 1024 4096 8192
    python3 bench/allreduce_norm.py --from-json FILE --plot FILE.png   # redraw, no GPU needed

Method (as ../shared/ANCHORS.md): CUDA-graph replays of 40 back-to-back calls, median of 7
replays, max over ranks; bf16; hidden 8192; inputs reset (untimed) before each replay so in-place
baselines stay finite. Columns:
  nccl_ar        NCCL all-reduce alone (in place)
  nccl_eager     NCCL all-reduce + eager ``x + res`` + ``F.rms_norm``
  nccl_compiled  NCCL all-reduce + the add+norm under torch.compile (one Triton kernel writing the
                 new residual and the norm, as the fused ops do)
  symm1_eager    torch symm_mem one_shot_all_reduce + eager add+norm
  symm2_ar       torch symm_mem two_shot_all_reduce_ alone
  ours           opfuse AllReduceAddRMSNorm, implementation chosen by the dispatch table
  ours_1shot / ours_2shot / ours_nccl   the same with the implementation forced (where capable;
                            nccl = NCCL all-reduce + opfuse's local add+norm kernel)
  fi             FlashInfer's fused all-reduce + residual + RMSNorm (TensorRT-LLM kernel) as vLLM
                 runs it on Hopper: fp32 accumulation, PDL, vLLM's one-shot/two-shot choice
                 (``fi_path``; ``fi_vllm``: whether vLLM would use the fused kernel at that size).
                 Needs the headers of tools/fetch_flashinfer.py (``.thirdparty/flashinfer/``) and
                 world 2, 4 or 8; otherwise skipped with the reason (bench/flashinfer_ar/).
  ours_ar        opfuse plain AllReduce (implementation chosen by the dispatch table)
  addnorm_*      single-GPU add+RMSNorm: opfuse kernel / eager / compiled (rank 0)
  floor          bandwidth floor of the fused op (bench/timing.py ``allreduce_floor_us``): the bytes
                 each rank must send over NVLink, 2 (W - 1) / W x message, over the peer egress
                 measured at the start of the run (best of NCCL all-gather and copy-engine pushes),
                 or the 4 messages of HBM traffic over the measured copy rate, whichever is larger
  err            relative error of opfuse's and FlashInfer's outputs against a float64 reference

torch.compile (torch 2.11): the add+norm is compiled once per size with static shapes (dynamo is
reset before each size; the default ``dynamic=None`` would otherwise switch to a dynamic-shape
kernel from the second size on, 10-14 % slower at >= 1024 tokens), default mode (Inductor's own
CUDA graphs stay off: the bench captures the compiled function into its own graph after the
warm-up calls have compiled it).
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


def add_norm(a, r, w):
    """The add+norm the baselines compile: the new residual and its RMSNorm (both are outputs of
    the fused op, so the compiled kernel writes both too)."""
    h = a + r
    return F.rms_norm(h, (h.shape[-1],), w, EPS), h


def compiled_for_this_size():
    """torch.compile of ``add_norm`` specialised to the next shape it sees (see the module docstring)."""
    torch._dynamo.reset()
    return torch.compile(add_norm)


def open_flashinfer(world, max_message):
    """(FlashInferFusion, None) or (None, the reason the column is skipped)."""
    try:
        from flashinfer_ar.build import FlashInferUnavailable
        from flashinfer_ar.fusion import FlashInferFusion
    except ImportError as error:
        return None, f"bench/flashinfer_ar not importable: {error}"
    try:
        return FlashInferFusion(dist.group.WORLD, max_message), None
    except FlashInferUnavailable as error:
        return None, str(error).splitlines()[0][:200]
    except Exception as error:  # noqa: BLE001 - e.g. symmetric memory refused: the column is skipped, not the run
        return None, f"workspace setup failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}"


def rel_err(got, ref):
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def worker(rank, world, opts, out_path):
    from torch.distributed import _symmetric_memory as symm_mem
    from timing import allreduce_floor_us, device_copy_gbs, peer_egress_gbs

    torch.manual_seed(1234 + rank)
    dtype = getattr(torch, opts["dtype"])
    group_name = dist.group.WORLD.group_name
    rows = []
    ceilings = {"peer_egress_gbs": peer_egress_gbs(), "hbm_copy_gbs": max_over_ranks_min(device_copy_gbs())}
    element = torch.empty((), dtype=dtype).element_size()
    max_message = max(opts["hidden"]) * max(opts["tokens"]) * element
    if not opts["flashinfer"]:
        fi, fi_why = None, "--no-flashinfer"
    elif dtype == torch.float32:
        fi, fi_why = None, "float32: not built"
    else:
        fi, fi_why = open_flashinfer(world, max_message)
    for hidden in opts["hidden"]:
        weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
        for tokens in opts["tokens"]:
            compiled_add_norm = compiled_for_this_size()
            x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
            res = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
            buf = torch.empty_like(x)
            symm = symm_mem.empty(tokens, hidden, dtype=dtype, device="cuda")
            symm_mem.rendezvous(symm, group_name)
            reset_buf = lambda: buf.copy_(x)  # noqa: E731
            reset_symm = lambda: symm.copy_(x)  # noqa: E731
            message = x.numel() * x.element_size()
            row = {"hidden": hidden, "tokens": tokens, "bytes": message, "err": {}}
            row["floor"], row["floor_bound"] = allreduce_floor_us(message, world, ceilings["peer_egress_gbs"]["best"],
                                                                  ceilings["hbm_copy_gbs"])
            h_ref = x.double()
            dist.all_reduce(h_ref)
            h_ref += res.double()
            y_ref = F.rms_norm(h_ref, (hidden,), weight.double(), EPS)

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
                y, h = block(x, res)
                row["err"]["ours_y"], row["err"]["ours_h"] = rel_err(y, y_ref), rel_err(h, h_ref)
                row["ours_impl"] = opfuse.compile(block, x, res).fusions[0].impl
                row["ours"] = graph_time_us(lambda: block(x, res))
                row.update(flashinfer_columns(fi, fi_why, world, x, res, weight, y_ref, h_ref, row["err"]))
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
            errs = list(row["err"].items())
            row["err"] = dict(zip([k for k, _ in errs], max_over_ranks_list([v for _, v in errs])))
            rows.append(row)
            del h_ref, y_ref
            if rank == 0:
                common.progress(f"world {world}: hidden {hidden}, {tokens} tokens done")
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump({"rows": rows, "ceilings": ceilings, "flashinfer": fi_why or "measured"}, handle)


def flashinfer_columns(fi, why, world, x, res, weight, y_ref, h_ref, err) -> dict:
    """The FlashInfer kernel on this size, with vLLM's one-shot/two-shot choice."""
    if fi is None:
        return {"fi": None, "fi_why": why}
    from flashinfer_ar.fusion import vllm_fuses, vllm_uses_oneshot

    tokens, hidden = x.shape
    message = x.numel() * x.element_size()
    oneshot = vllm_uses_oneshot(message, world)
    cols = {"fi_path": "1shot" if oneshot else "2shot", "fi_vllm": vllm_fuses(message, world)}
    why = fi.can_run(tokens, message, oneshot)
    if why:
        return {**cols, "fi": None, "fi_why": why}
    norm_out, residual_out = torch.empty_like(x), torch.empty_like(x)

    def call():
        fi(x, res, weight, EPS, norm_out, residual_out, oneshot=oneshot)

    try:
        call()  # argument errors come back as exceptions, the same on every rank
    except (ValueError, RuntimeError) as error:
        return {**cols, "fi": None, "fi_why": str(error).splitlines()[0][:200]}
    torch.cuda.synchronize()
    err["fi_y"], err["fi_h"] = rel_err(norm_out, y_ref), rel_err(residual_out, h_ref)
    cols["fi"] = graph_time_us(call)
    return cols


def max_over_ranks_list(values):
    t = torch.tensor(values, device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def max_over_ranks_min(value):
    """The smallest ``value`` over ranks (a ceiling is as high as the slowest GPU's)."""
    return -max_over_ranks_list([-value])[0]


def fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _rows(result) -> list:
    """A world's rows: runs record ``{"rows", "ceilings", "flashinfer"}``, older ones only the rows."""
    return result["rows"] if isinstance(result, dict) else result


def table(world, result) -> str:
    """One table per hidden size (the layout tools/allreduce_table_to_json.py reads back)."""
    rows = _rows(result)
    ceilings = result.get("ceilings") if isinstance(result, dict) else None
    notes = []
    if ceilings:
        peer = ceilings["peer_egress_gbs"]
        notes.append(f"measured ceilings: peer egress {fmt(peer['best'], 0)} GB/s (NCCL all-gather "
                     f"{fmt(peer['nccl'], 0)}, copy engine {fmt(peer['copy_engine'], 0)}), HBM copy "
                     f"{fmt(ceilings['hbm_copy_gbs'], 0)} GB/s; FlashInfer: {result.get('flashinfer', '-')}; "
                     f"FI path * = vLLM would not call the fused kernel at that size")
    lines = []
    for hidden in dict.fromkeys(r["hidden"] for r in rows):
        lines += [f"\nworld {world}, {hidden} hidden, bf16, microseconds per call "
                  f"(CUDA graph of {CALLS} calls, median of {REPLAYS}, max over ranks)", *notes,
                  "| tokens | bytes | NCCL AR | NCCL+eager | NCCL+compiled | symm1+eager | symm2 AR | ours | impl | "
                  "ours/compiled | ours/symm1 | ours/symm2 | ours 1shot | ours 2shot | ours nccl | AR ours | "
                  "AR ours/NCCL | add+norm ours/compiled | FlashInfer | FI path | ours/FI | floor | ours/floor |",
                  "|" + "---|" * 23]
        for r in (r for r in rows if r["hidden"] == hidden):
            fi_path = (r.get("fi_path") or "-") + ("" if r.get("fi_vllm", True) else "*")
            floor = f"{fmt(r['floor'])} ({r['floor_bound']})" if r.get("floor") is not None else "-"
            lines.append(
                f"| {r['tokens']} | {r['bytes'] >> 10} KiB | {fmt(r['nccl_ar'])} | {fmt(r['nccl_eager'])} | "
                f"{fmt(r['nccl_compiled'])} | {fmt(r['symm1_eager'])} | {fmt(r['symm2_ar'])} | {fmt(r['ours'])} | "
                f"{r['ours_impl']} | {r['ours'] / r['nccl_compiled']:.2f} | {r['ours'] / r['symm1_eager']:.2f} | "
                f"{r['ours'] / r['symm2_ar']:.2f} | {fmt(r.get('ours_1shot'))} | {fmt(r.get('ours_2shot'))} | "
                f"{fmt(r.get('ours_nccl'))} | "
                f"{fmt(r['ours_ar'])} | {r['ours_ar'] / r['nccl_ar']:.2f} | "
                f"{r['addnorm_ours'] / r['addnorm_compiled']:.2f} "
                f"({fmt(r['addnorm_ours'])}/{fmt(r['addnorm_compiled'])}) | "
                f"{fmt(r.get('fi'))} | {fi_path} | {fmt(ratio(r['ours'], r.get('fi')), 2)} | {floor} | "
                f"{fmt(ratio(r['ours'], r.get('floor')), 2)} |")
        errs = [f"{r['tokens']}: " + ", ".join(f"{k} {v:.1e}" for k, v in r["err"].items())
                for r in rows if r["hidden"] == hidden and r.get("err")]
        if errs:
            lines.append("relative errors vs float64 (tokens: output): " + "; ".join(errs))
    return "\n".join(lines)


# Issue 21's targets: opfuse <= 0.9x FlashInfer and never slower than NCCL + compiled add+norm.
TARGET_FI, TARGET_COMPILED = 0.90, 1.00


def summary(results) -> str:
    """The headline table, printed last: FlashInfer / opfuse / NCCL + compiled and the floor."""
    lines = [f"\nsummary (us; targets: ours/FI <= {TARGET_FI}, ours/compiled <= {TARGET_COMPILED})",
             "| world | hidden | tokens | FlashInfer | ours | impl | NCCL+compiled | floor | ours/FI | ours/compiled | "
             "ours/floor | met |", "|" + "---|" * 12]
    for world, result in results.items():
        for r in _rows(result):
            to_fi, to_compiled = ratio(r["ours"], r.get("fi")), ratio(r["ours"], r["nccl_compiled"])
            met = (to_fi is None or to_fi <= TARGET_FI) and to_compiled <= TARGET_COMPILED
            lines.append(f"| {world} | {r['hidden']} | {r['tokens']} | {fmt(r.get('fi'))} | {fmt(r['ours'])} | "
                         f"{r['ours_impl']} | {fmt(r['nccl_compiled'])} | {fmt(r.get('floor'))} | {fmt(to_fi, 2)} | "
                         f"{fmt(to_compiled, 2)} | {fmt(ratio(r['ours'], r.get('floor')), 2)} | "
                         f"{'yes' if met else 'NO'} |")
    return "\n".join(lines)


def ratio_series(results) -> dict:
    """The chart: opfuse / (NCCL + compiled add+norm) per world and hidden size, against tokens."""
    series = {}
    for world, result in results.items():
        for r in _rows(result):
            label = f"world {world}, hidden {r['hidden']}: opfuse / NCCL+compiled"
            series.setdefault(label, []).append((r["tokens"], r["ours"] / r["nccl_compiled"]))
    return series


def main() -> int:
    parser = common.parser("allreduce_norm", __doc__)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hidden", type=int, nargs="+", default=[8192])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512, 2048, 8192])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--no-flashinfer", action="store_true", help="leave the FlashInfer column empty")
    args = parser.parse_args()

    def measure():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        measured = {}
        for world in common.worlds(args.world):
            common.progress(f"world {world}: {len(args.hidden) * len(args.tokens)} cases")
            opts = {"hidden": args.hidden, "tokens": args.tokens, "dtype": args.dtype,
                    "flashinfer": not args.no_flashinfer}
            measured[str(world)] = common.run_ranks(worker, world, opts)
            print(table(world, measured[str(world)]), flush=True)  # as each world finishes
        return measured

    measuring = not args.from_json
    results = common.results(args, "allreduce_norm", min(args.world), measure)
    if results is None:
        return 0
    if not measuring:
        for world, result in results.items():
            print(table(world, result), flush=True)
    print(summary(results), flush=True)
    common.finish(args, results, series=ratio_series(results), xlabel="tokens",
                  ylabel="time ratio (< 1: opfuse faster)",
                  title="all-reduce + bias + residual + RMSNorm: opfuse / (NCCL all-reduce + compiled add+norm)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
