"""NVIDIA's libraries as opfuse implementations, side by side with opfuse's own and torch's, in one
run (ratios only mean something within a run). Decides the dispatch order of ``cudnn`` and
``cublasmp`` in opfuse/core/dispatch.py.

    PYTHONPATH=. python3 bench/nvidia_libs.py                      # every part
    PYTHONPATH=. python3 bench/nvidia_libs.py --part norms grouped epilogue
    PYTHONPATH=. python3 bench/nvidia_libs.py --part cublasmp --world 2 4 [--json FILE] [--plot FILE.png]
    python3 bench/nvidia_libs.py --from-json FILE                  # the tables again, no GPU needed

Parts (bf16; microseconds per call):

* ``norms`` (one GPU): ``h = x + residual``, ``y = RMSNorm / LayerNorm(h)`` at hidden 8192 and 1 ...
  8192 tokens; forward and backward (with the residual's gradient summed in, as in a block):
  opfuse ``cuda`` (the fused kernels, both directions), ``cudnn``, and torch.compile of the same
  math (forward: add + norm; backward: the closed-form gradient). CUDA graph of 40 calls, median of
  7 replays. Floor: either direction moves four [tokens, hidden] tensors (forward: reads x and the
  residual, writes h and y; backward: reads dy, h and the residual's gradient, writes dh) plus the
  parameters, over the HBM copy bandwidth measured in the run.
* ``grouped`` (one GPU): the MoE grouped GEMM, 32 experts, K=7168, N=2048, 32768 and 256 routed
  tokens, forward: ``cudnn`` vs ``triton`` vs ``torch_grouped_mm`` (CUDA graph, as above).
* ``epilogue`` (one GPU): GEMM + bias + GELU(tanh), inference, 128 / 2048 / 8192 tokens, K=8192,
  N=28672/2: ``cudnn`` vs ``cublaslt_epilogue`` vs addmm-then-gelu.
* ``cublasmp`` (NCCL, ``--world``): AG+GEMM and GEMM+RS forward, M = 512 ... 8192 tokens over all
  ranks, K=8192, N=28672/world: the local GEMM alone, NCCL then GEMM, opfuse ``p2p_overlap``,
  ``cublasmp`` (eager, batches of 10, median of 7, max over ranks, interleaved: bench/overlap.py's
  method), and the error of each against NCCL then GEMM.

A column whose implementation cannot run here shows ``-`` and the reason is printed under the
tables. Each table ends with where the library's implementation wins. ``--plot`` draws the
library / opfuse time ratios against the size.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (bench/common.py)
from opfuse.core import dispatch as implementations  # noqa: E402
from opfuse.machinery.implementation import CallSpec  # noqa: E402
from opfuse.families.residual_norm import reference as norm_reference  # noqa: E402
from opfuse.ops.base import TensorMeta  # noqa: E402
from timing import device_copy_gbs, graph_replay_us, median  # noqa: E402  (bench/timing.py)

CALLS, REPLAYS = 40, 7
BF16 = torch.bfloat16
PARTS = ("norms", "grouped", "epilogue", "cublasmp")
notes: list[str] = []  # why a column is empty (filled while measuring, saved with the rows)


def graph_us(fn, calls=CALLS) -> float | None:
    return median(graph_replay_us(fn, calls, REPLAYS))


def attempt(what, fn):
    """``fn()``, or ``None`` with the reason noted under the table."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - a column that cannot run is reported, not fatal
        notes.append(f"{what}: {type(error).__name__}: {str(error).splitlines()[0][:240] if str(error) else ''}")
        return None


def prepared(op, impl, spec):
    """The implementation ``impl`` of ``op`` after its check and prepare (what compiling does)."""
    chosen = implementations.get(op, impl)
    reason = chosen.check(spec)
    if reason:
        raise RuntimeError(f"{impl} cannot run {op} here: {reason}")
    chosen.prepare(spec)
    return chosen


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def ratio(a, b):
    return "-" if a is None or b is None else f"{a / b:.2f}"


def markdown(head, rows):
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


# Norms ----------------------------------------------------------------------------------------------------------


def measure_norms(tokens_list, hidden) -> list[dict]:
    eps = 1e-5
    fwd_compiled = {
        "rms": torch.compile(lambda x, r, w, b: torch.nn.functional.rms_norm(x + r, (hidden,), w, eps), dynamic=True),
        "layer": torch.compile(lambda x, r, w, b: torch.nn.functional.layer_norm(x + r, (hidden,), w, b, eps),
                               dynamic=True)}
    bwd_compiled = {norm: torch.compile(lambda dy, h, dh, w, b, norm=norm: norm_reference.backward(
        dy, h, dh, w, b, eps, norm=norm), dynamic=True) for norm in ("rms", "layer")}
    hbm_gbs = attempt("HBM copy bandwidth", device_copy_gbs)
    rows = []
    for norm in ("rms", "layer"):
        op = "add_rmsnorm" if norm == "rms" else "add_layernorm"
        for tokens in tokens_list:
            gen = torch.Generator(device="cuda").manual_seed(tokens)
            rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda").to(BF16)  # noqa: E731
            x, r, dy, dh = rnd(tokens, hidden), rnd(tokens, hidden), rnd(tokens, hidden), rnd(tokens, hidden)
            w, b = 1 + 0.1 * rnd(hidden), (0.1 * rnd(hidden) if norm == "layer" else None)
            h = x + r
            meta = TensorMeta.of(x)
            spec = CallSpec(op=op, inputs={"x": meta, "residual": meta, "bias": None, "weight": TensorMeta.of(w),
                                           "norm_bias": None if b is None else TensorMeta.of(b)},
                            attrs={"norm": norm, "eps": eps, "write_residual": True}, requires_grad=True)
            row = {"norm": norm, "tokens": tokens}
            if hbm_gbs:  # 4 activations + the parameters (w; LayerNorm: w, b) read and their gradients written
                moved = (4 * tokens * hidden + (4 if norm == "layer" else 2) * hidden) * x.element_size()
                row["floor"], row["hbm_gbs"] = moved / hbm_gbs / 1e3, hbm_gbs
            ref_y = norm_reference.forward(x, None, r, w, b, eps, "", False, norm=norm)[0]
            for impl in ("cuda", "cudnn"):
                chosen = attempt(f"{op} {impl} {tokens} tokens", lambda: prepared(op, impl, spec))
                if chosen is None:
                    continue
                fwd = lambda: chosen.forward(x, None, r, w, b, eps, "", True)  # noqa: E731
                bwd = lambda: chosen.backward(dy, h, dh, w, b, eps)  # noqa: E731
                row[f"{impl}_err"] = attempt(f"{op} {impl} error", lambda: rel(fwd()[0], ref_y))
                row[f"{impl}_fwd"] = attempt(f"{op} {impl} forward {tokens}", lambda: graph_us(fwd))
                row[f"{impl}_bwd"] = attempt(f"{op} {impl} backward {tokens}", lambda: graph_us(bwd))
            row["compiled_fwd"] = attempt(f"{op} compiled forward", lambda: graph_us(
                lambda: fwd_compiled[norm](x, r, w, b)))
            row["compiled_bwd"] = attempt(f"{op} compiled backward", lambda: graph_us(
                lambda: bwd_compiled[norm](dy, h, dh, w, b)))
            rows.append(row)
            common.progress(f"norms: {norm} {tokens} tokens done")
    return rows


def table_norms(rows, hidden) -> str:
    head = ["norm", "tokens", "floor", "fwd cuda", "fwd cudnn", "fwd compiled", "cudnn/cuda", "cudnn/compiled",
            "bwd cuda", "bwd cudnn", "bwd compiled", "cudnn/cuda", "cudnn/compiled", "fwd cuda/floor", "bwd cuda/floor",
            "cudnn err"]
    body = [[r["norm"], r["tokens"], fmt(r.get("floor")), fmt(r.get("cuda_fwd")), fmt(r.get("cudnn_fwd")),
             fmt(r.get("compiled_fwd")), ratio(r.get("cudnn_fwd"), r.get("cuda_fwd")),
             ratio(r.get("cudnn_fwd"), r.get("compiled_fwd")), fmt(r.get("cuda_bwd")), fmt(r.get("cudnn_bwd")),
             fmt(r.get("compiled_bwd")), ratio(r.get("cudnn_bwd"), r.get("cuda_bwd")),
             ratio(r.get("cudnn_bwd"), r.get("compiled_bwd")), ratio(r.get("cuda_fwd"), r.get("floor")),
             ratio(r.get("cuda_bwd"), r.get("floor")), err(r.get("cudnn_err"))] for r in rows]
    hbm = next((r["hbm_gbs"] for r in rows if r.get("hbm_gbs")), None)
    wins = [f"{r['norm']}@{r['tokens']} {d}" for r in rows for d in ("fwd", "bwd")
            if r.get(f"cudnn_{d}") is not None and r.get(f"cuda_{d}") is not None and r[f"cudnn_{d}"] < r[f"cuda_{d}"]]
    return (f"Add + norm, hidden {hidden}, bf16, us per call (CUDA graph of {CALLS} calls, median of {REPLAYS}); "
            f"bwd includes the residual gradient; floor: 4 activations over HBM at {fmt(hbm, 0)} GB/s\n"
            + markdown(head, body) + f"\ncudnn faster than cuda: {', '.join(wins) or 'nowhere'}")


# Grouped GEMM -----------------------------------------------------------------------------------------------------


def measure_grouped(shapes) -> list[dict]:
    rows = []
    for tokens, experts, k, n in shapes:
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        choice = torch.randint(0, experts, (tokens,), generator=torch.Generator().manual_seed(tokens))
        counts = torch.bincount(choice, minlength=experts).to(torch.int32).cuda()
        x = torch.randn(tokens, k, generator=gen, device="cuda").to(BF16)
        w = (torch.randn(experts, n, k, generator=gen, device="cuda") / math.sqrt(k)).to(BF16)
        spec = CallSpec("grouped_linear", {"x": TensorMeta.of(x), "group_sizes": TensorMeta.of(counts),
                                           "weight": TensorMeta.of(w), "bias": None}, {"fsdp": False})
        ref = implementations.get("grouped_linear", "torch_grouped_mm").forward(x, counts, w, None)
        row = {"tokens": tokens, "experts": experts}
        for impl in ("triton", "torch_grouped_mm", "cudnn"):
            chosen = attempt(f"grouped {impl} {tokens}", lambda: prepared("grouped_linear", impl, spec))
            if chosen is None:
                continue
            fn = lambda: chosen.forward(x, counts, w, None)  # noqa: E731
            row[f"{impl}_err"] = attempt(f"grouped {impl} error", lambda: rel(fn(), ref))
            row[impl] = attempt(f"grouped {impl} time", lambda: graph_us(fn, calls=10))
        rows.append(row)
        common.progress(f"grouped: {tokens} tokens done")
    return rows


def table_grouped(rows) -> str:
    head = ["tokens", "experts", "triton", "torch_grouped_mm", "cudnn", "cudnn/triton", "cudnn/grouped_mm", "cudnn err"]
    body = [[r["tokens"], r["experts"], fmt(r.get("triton")), fmt(r.get("torch_grouped_mm")), fmt(r.get("cudnn")),
             ratio(r.get("cudnn"), r.get("triton")), ratio(r.get("cudnn"), r.get("torch_grouped_mm")),
             err(r.get("cudnn_err"))] for r in rows]
    wins = [str(r["tokens"]) for r in rows if r.get("cudnn") is not None and r.get("triton") is not None
            and r["cudnn"] < r["triton"]]
    return ("Grouped GEMM forward, K=7168, N=2048, bf16, us per call (CUDA graph of 10 calls)\n" + markdown(head, body)
            + f"\ncudnn faster than triton at: {', '.join(wins) or 'nowhere'} tokens")


# GEMM + bias + GELU ------------------------------------------------------------------------------------------------


def measure_epilogue(tokens_list, k, n) -> list[dict]:
    rows = []
    for tokens in tokens_list:
        gen = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, k, generator=gen, device="cuda").to(BF16)
        w = (torch.randn(n, k, generator=gen, device="cuda") / math.sqrt(k)).to(BF16)
        b = torch.randn(n, generator=gen, device="cuda").to(BF16)
        spec = CallSpec("linear_bias_activation", {"x": TensorMeta.of(x), "weight": TensorMeta.of(w),
                                                   "bias": TensorMeta.of(b)}, {"activation": "gelu_tanh"})
        ref = implementations.get("linear_bias_activation", "reference").forward(x, w, b, "gelu_tanh", False)[0]
        row = {"tokens": tokens, "k": k, "n": n}
        for impl in ("reference", "cublaslt_epilogue", "cudnn"):
            chosen = attempt(f"epilogue {impl} {tokens}", lambda: prepared("linear_bias_activation", impl, spec))
            if chosen is None:
                continue
            fn = lambda: chosen.forward(x, w, b, "gelu_tanh", False)  # noqa: E731
            row[f"{impl}_err"] = attempt(f"epilogue {impl} error", lambda: rel(fn()[0], ref))
            row[impl] = attempt(f"epilogue {impl} time", lambda: graph_us(fn, calls=10))
        rows.append(row)
        common.progress(f"epilogue: {tokens} tokens done")
    return rows


def table_epilogue(rows) -> str:
    head = ["tokens", "addmm+gelu", "cublaslt", "cudnn", "cudnn/cublaslt", "cudnn err"]
    body = [[r["tokens"], fmt(r.get("reference")), fmt(r.get("cublaslt_epilogue")), fmt(r.get("cudnn")),
             ratio(r.get("cudnn"), r.get("cublaslt_epilogue")), err(r.get("cudnn_err"))] for r in rows]
    shape = f"K={rows[0]['k']}, N={rows[0]['n']}" if rows else ""
    return f"GEMM + bias + GELU(tanh), inference, {shape}, bf16, us per call (CUDA graph of 10 calls)\n" + \
        markdown(head, body)


# cuBLASMp ---------------------------------------------------------------------------------------------------------


def cublasmp_worker(rank, world, cfg, out_path):
    import torch.distributed as dist

    from overlap import eager_interleaved, reserve  # noqa: PLC0415  (bench/overlap.py)
    from opfuse.families.collective_linear import cublasmp as mp_impl
    from opfuse.families.collective_linear import p2p
    from torch.distributed import _symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        enable(dist.group.WORLD.group_name)
    pg = dist.group.WORLD
    name = pg.group_name
    k, n = cfg["k"], cfg["ffn"] // world
    rows = []
    for m in sorted(cfg["ms"], reverse=True):  # largest first: cuBLASMp's NVSHMEM workspace is sized once
        for op in ("AG+GEMM", "GEMM+RS"):
            gen = torch.Generator(device="cuda").manual_seed(17 + rank)
            rnd = lambda *s: (torch.randn(*s, generator=gen, device="cuda") * 0.05).to(BF16)  # noqa: E731
            row = {"world": world, "M": m, "op": op, "k": k, "ffn": cfg["ffn"]}
            with torch.no_grad():
                if op == "AG+GEMM":
                    x, w = rnd(m // world, k), rnd(n, k)
                    full, y = torch.empty(m, k, device="cuda", dtype=BF16), torch.empty(m, n, device="cuda", dtype=BF16)
                    gemm = lambda: torch.mm(full, w.t(), out=y)  # noqa: E731

                    def nccl_gemm():
                        dist.all_gather_into_tensor(full, x, group=pg)
                        return torch.mm(full, w.t(), out=y)

                    fused_op, attrs = "all_gather_linear", {}
                    ours = lambda: p2p.all_gather_linear_forward(x, w, None, group=name)  # noqa: E731
                    theirs = lambda: mp_impl.all_gather_linear_forward(x, w, None, name)  # noqa: E731
                else:
                    x, w = rnd(m, n), rnd(k, n)
                    partial, out = torch.empty(m, k, device="cuda", dtype=BF16), torch.empty(
                        m // world, k, device="cuda", dtype=BF16)
                    gemm = lambda: torch.mm(x, w.t(), out=partial)  # noqa: E731

                    def nccl_gemm():
                        torch.mm(x, w.t(), out=partial)
                        dist.reduce_scatter_tensor(out, partial, group=pg)
                        return out

                    fused_op, attrs = "linear_reduce_scatter", {"bias_after": True}
                    ours = lambda: p2p.linear_reduce_scatter_forward(x, w, None, True, name)  # noqa: E731
                    theirs = lambda: mp_impl.linear_reduce_scatter_forward(x, w, None, True, name)  # noqa: E731
                ref = nccl_gemm().clone()
                fns = {"gemm": gemm, "nccl+gemm": nccl_gemm}
                try:
                    reserve(fused_op, x, w, pg, **attrs)
                    row["ours_err"] = rel(ours(), ref)
                    fns["ours"] = ours
                except Exception as error:  # noqa: BLE001 - reported under the table
                    row["ours_error"] = f"{type(error).__name__}: {error}"[:240]
                try:
                    spec = CallSpec(op=fused_op, inputs={"x": TensorMeta.of(x), "weight": TensorMeta.of(w),
                                                         "bias": None}, attrs=attrs, group_name=name, world_size=world)
                    prepared(fused_op, "cublasmp", spec)
                    row["cublasmp_err"] = rel(theirs(), ref)
                    fns["cublasmp"] = theirs
                except Exception as error:  # noqa: BLE001 - reported under the table
                    row["cublasmp_error"] = f"{type(error).__name__}: {error}"[:240]
                times, _ = eager_interleaved(fns, host_of="gemm")
                row.update(times)
            rows.append(row)
            torch.cuda.empty_cache()
            if rank == 0:
                common.progress(f"cublasmp: world {world} M={m} {op} done")
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(rows, handle)


def measure_cublasmp(worlds, ms, k, ffn) -> list[dict]:
    rows = []
    for world in common.worlds(worlds):
        rows += common.run_ranks(cublasmp_worker, world, {"ms": ms, "k": k, "ffn": ffn}, timeout=500)
    for r in rows:
        for key in ("ours_error", "cublasmp_error"):
            if r.get(key):
                notes.append(f"world {r['world']} M={r['M']} {r['op']} {key.split('_')[0]}: {r[key]}")
    return rows


def table_cublasmp(rows) -> str:
    head = ["world", "M", "op", "gemm", "nccl+gemm", "p2p_overlap", "cublasmp", "cublasmp/gemm",
            "cublasmp/p2p_overlap", "cublasmp/nccl+gemm", "err p2p", "err cublasmp"]
    body = [[r["world"], r["M"], r["op"], fmt(r.get("gemm"), 0), fmt(r.get("nccl+gemm"), 0), fmt(r.get("ours"), 0),
             fmt(r.get("cublasmp"), 0), ratio(r.get("cublasmp"), r.get("gemm")),
             ratio(r.get("cublasmp"), r.get("ours")), ratio(r.get("cublasmp"), r.get("nccl+gemm")),
             err(r.get("ours_err")), err(r.get("cublasmp_err"))] for r in rows]
    wins = [f"w{r['world']} M={r['M']} {r['op']}" for r in rows
            if r.get("cublasmp") is not None and r.get("ours") is not None and r["cublasmp"] < r["ours"]]
    shape = f"K={rows[0]['k']}, N={rows[0]['ffn']}/world" if rows else ""
    return (f"Comm + GEMM, bf16, {shape}, us per call (eager, batches of 10, median of 7, max over ranks)\n"
            + markdown(head, body) + f"\ncublasmp faster than p2p_overlap: {', '.join(wins) or 'nowhere'}")


# Report --------------------------------------------------------------------------------------------------------------


def err(value) -> str:
    return "-" if value is None else f"{value:.1e}"


def ratio_series(data) -> dict:
    """The chart: each library implementation's time over opfuse's, against the size."""
    series = {}
    for r in data.get("norms", []):
        for d in ("fwd", "bwd"):
            if r.get(f"cudnn_{d}") and r.get(f"cuda_{d}"):
                series.setdefault(f"{r['norm']}norm {d}: cudnn / cuda", []).append(
                    (r["tokens"], r[f"cudnn_{d}"] / r[f"cuda_{d}"]))
    for r in data.get("cublasmp", []):
        if r.get("cublasmp") and r.get("ours"):
            series.setdefault(f"world {r['world']} {r['op']}: cublasmp / p2p_overlap", []).append(
                (r["M"], r["cublasmp"] / r["ours"]))
    return series


def main() -> int:
    parser = common.parser("nvidia_libs", __doc__)
    parser.add_argument("--part", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512, 2048, 8192])
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--m", type=int, nargs="+", default=[512, 2048, 8192], help="tokens over all ranks")
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--ffn", type=int, default=28672)
    args = parser.parse_args()

    def measure():
        for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                           ("NVSHMEM_DISABLE_NVLS", "1")):
            os.environ.setdefault(var, value)
        from opfuse.runtime import cublasmp, cudnn_frontend

        data = {"libraries": [cudnn_frontend.describe(), cublasmp.describe()], "hidden": args.hidden}
        if "norms" in args.part:
            data["norms"] = measure_norms(args.tokens, args.hidden)
        if "grouped" in args.part:
            data["grouped"] = measure_grouped([(32768, 32, 7168, 2048), (256, 32, 7168, 2048)])
        if "epilogue" in args.part:
            data["epilogue"] = measure_epilogue([128, 2048, 8192], args.k, args.ffn // 2)
        if "cublasmp" in args.part:
            data["cublasmp"] = measure_cublasmp(args.world, args.m, args.k, args.ffn)
        data["notes"] = notes
        return data

    data = common.results(args, "nvidia_libs", 1, measure)
    if data is None:
        return 0
    print("\n".join(f"library: {line}" for line in data["libraries"]) + "\n")
    tables = {"norms": lambda rows: table_norms(rows, data["hidden"]), "grouped": table_grouped,
              "epilogue": table_epilogue, "cublasmp": table_cublasmp}
    for part, table in tables.items():
        if data.get(part):
            print(table(data[part]) + "\n")
    for note in data["notes"]:
        print(f"note: {note}")
    common.finish(args, data, series=ratio_series(data), xlabel="tokens (norms) / M (comm + GEMM)",
                  ylabel="time ratio (1 = opfuse's implementation)",
                  title="NVIDIA libraries: time over opfuse's implementation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
