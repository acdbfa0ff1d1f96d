"""Comm + GEMM overlap: opfuse's ``p2p_overlap`` against the GEMM alone, the collective alone,
NCCL-then-GEMM and torch symmetric memory's fused ops, in one run (ratios only mean something
within a run).

    PYTHONPATH=. python3 bench/overlap.py --world 2 4 [--json FILE] [--plot FILE.png]
    python3 bench/overlap.py --from-json FILE --plot FILE.png   # redraw, no GPU needed

Cases (as ../shared/ANCHORS.md, "Comm + GEMM overlap"): bf16, M in {2048, 8192} tokens (all
ranks), K = 8192 hidden, N = 28672 / world.

* ``AG+GEMM`` (column-parallel, sequence-parallel): ``all_gather(x[M/world, K]) @ W[N, K].T``.
* ``GEMM+RS`` (row-parallel, the transpose): ``reduce_scatter(x[M, N] @ W[K, N].T)``.

Columns (microseconds per call; eager calls back to back, batches of CALLS after WARMUP, median of
REPS batches, max over ranks; every batch starts after a barrier; the batches of gemm, coll,
nccl+gemm, torch and ours are interleaved, so drift within a case does not bias their ratios):

  gemm        the local GEMM alone (the full-M GEMM of one rank)
  coll        the NCCL collective alone
  nccl+gemm   NCCL collective then GEMM (AG) / GEMM then NCCL collective (RS): no overlap
  torch       torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter
  ours        opfuse p2p_overlap forward (what a compiled program calls), eager
  host        Python issue time of one eager ``ours`` call (host-bound when close to ``ours``)
  plan        what the policy picked (rank 0): schedule, GEMMs per call, ``2s`` = two GEMM streams
  ours:graph  the same, CUDA graph of CALLS calls (no Python launch overhead)
  ours:1s     eager, chunk GEMMs forced onto one stream (OPFUSE_OVERLAP_ALTERNATE_STREAMS=off)
  ours:2s     eager, chunk GEMMs forced to alternate between two streams (=on)
  ours:cN     eager with OPFUSE_OVERLAP_CHUNKS=N (tuning information: for GEMM+RS, 1 = the direct
              schedule, N >= 2 = the ring with N sub-chunks; for AG+GEMM, 1 = one GEMM per shard
              (no grouping), N >= 2 = N row sub-chunks per shard)
  err         ||ours - nccl+gemm|| / ||nccl+gemm|| (correctness of what was timed)

Targets: ours <= 1.05x (AG) / 1.03x (RS) of gemm at M=8192, <= 1.10x at M=2048, and faster than
nccl+gemm and torch everywhere.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import opfuse  # noqa: E402
import common  # noqa: E402  (bench/common.py)
from opfuse.core import dispatch as implementations  # noqa: E402
from opfuse.machinery.implementation import CallSpec  # noqa: E402
from opfuse.runtime.symm_pool import open_pool  # noqa: E402
from timing import graph_replay_us, max_over_ranks, median  # noqa: E402  (bench/timing.py)
from opfuse.ops.base import TensorMeta  # noqa: E402

CALLS, REPS, WARMUP = 10, 7, 3
TARGETS = {("AG+GEMM", 8192): 1.05, ("GEMM+RS", 8192): 1.03, ("AG+GEMM", 2048): 1.10, ("GEMM+RS", 2048): 1.10}
COLUMNS = ["gemm", "coll", "nccl+gemm", "torch", "ours", "host", "ours:graph", "ours:1s", "ours:2s"]


def _batch(fn):
    """One timed batch of CALLS back-to-back eager calls: (GPU us per call, host issue us per call)."""
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    issue = (time.perf_counter() - t0) * 1e6 / CALLS
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / CALLS, issue


def eager_us(fn) -> float:
    """GPU time per call of CALLS back-to-back eager calls (median of REPS batches, max over ranks)."""
    for _ in range(WARMUP):
        fn()
    return max_over_ranks(median([_batch(fn)[0] for _ in range(REPS)]))


def eager_interleaved(fns: dict, host_of: str) -> tuple[dict, float]:
    """:func:`eager_us` of every function in ``fns``, their batches interleaved (rep 1 of each,
    rep 2 of each, ...) so that clock or thermal drift during a case biases none of the ratios;
    also the host issue time per call of ``fns[host_of]``."""
    for fn in fns.values():
        for _ in range(WARMUP):
            fn()
    gpu = {name: [] for name in fns}
    issue = []
    for _ in range(REPS):
        for name, fn in fns.items():
            t, h = _batch(fn)
            gpu[name].append(t)
            if name == host_of:
                issue.append(h)
    return ({name: max_over_ranks(median(v)) for name, v in gpu.items()},
            max_over_ranks(median(issue)))


def plan_summary() -> str:
    """Rank 0's most recently bound overlap plan: schedule, GEMMs per call, streams."""
    from opfuse.families.collective_linear.overlap import plan as P
    from opfuse.families.collective_linear.overlap import resources

    ctx = resources._CONTEXTS.get((dist.group.WORLD.group_name, torch.cuda.current_device()))
    if ctx is None or not ctx.plans:
        return "-"
    plan = list(ctx.plans.values())[-1].plan
    kind = "direct" if "direct" in plan.shapes else "ring" if "ring" in plan.shapes else "gather"
    gemms = sum(1 for i in plan.instructions if isinstance(i, P.Gemm))
    two = any(i.stream == P.AUX for i in plan.instructions)
    return f"{kind} {gemms}g {'2s' if two else '1s'}"


def graph_us(fn) -> float:
    return max_over_ranks(median(graph_replay_us(fn, CALLS, REPS, warmup=WARMUP)))


def rel_err(got, ref) -> float:
    got, ref = got.double(), ref.double()
    return max_over_ranks(((got - ref).norm() / ref.norm().clamp_min(1e-30)).item())


def reserve(op: str, x, weight, group, **attrs):
    """What compiling a program does before the first call: open the group's pool (collective),
    check, and prepare (reserve the symmetric regions, bind the plans); fails loudly if the overlap
    cannot run here."""
    spec = CallSpec(op=op, inputs={"x": TensorMeta.of(x), "weight": TensorMeta.of(weight), "bias": None},
                    attrs=attrs, group_name=group.group_name, world_size=dist.get_world_size(group))
    open_pool(group, x.device)
    chosen = implementations.get(op, "p2p_overlap")
    reason = chosen.check(spec)
    if reason is not None:
        raise RuntimeError(f"p2p_overlap cannot run {op} here: {reason}")
    chosen.prepare(spec)


def bench_case(rank, world, op, m, k, n, chunk_settings):
    from opfuse.families.collective_linear import p2p as impl

    pg = dist.group.WORLD
    name = pg.group_name
    gen = torch.Generator(device="cuda").manual_seed(17 + rank)
    dt = torch.bfloat16
    rnd = lambda *s: (torch.randn(*s, generator=gen, device="cuda") * 0.05).to(dt)  # noqa: E731
    row = {"world": world, "M": m, "op": op}
    with torch.no_grad():
        if op == "AG+GEMM":
            x, w = rnd(m // world, k), rnd(n, k)
            full, y = torch.empty(m, k, device="cuda", dtype=dt), torch.empty(m, n, device="cuda", dtype=dt)
            wt = w.t()
            gemm = lambda: torch.mm(full, wt, out=y)  # noqa: E731
            coll = lambda: dist.all_gather_into_tensor(full, x, group=pg)  # noqa: E731

            def nccl_gemm():
                dist.all_gather_into_tensor(full, x, group=pg)
                return torch.mm(full, wt, out=y)

            torch_fused = lambda: torch.ops.symm_mem.fused_all_gather_matmul(x, [wt], 0, name)[1][0]  # noqa: E731
            reserve("all_gather_linear", x, w, pg)
            ours = lambda: impl.all_gather_linear_forward(x, w, None, group=name)  # noqa: E731
        else:
            x, w = rnd(m, n), rnd(k, n)
            partial = torch.empty(m, k, device="cuda", dtype=dt)
            out = torch.empty(m // world, k, device="cuda", dtype=dt)
            wt = w.t()
            gemm = lambda: torch.mm(x, wt, out=partial)  # noqa: E731
            coll = lambda: dist.reduce_scatter_tensor(out, partial, group=pg)  # noqa: E731

            def nccl_gemm():
                torch.mm(x, wt, out=partial)
                dist.reduce_scatter_tensor(out, partial, group=pg)
                return out

            torch_fused = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(x, wt, "sum", 0, name)  # noqa: E731
            reserve("linear_reduce_scatter", x, w, pg, bias_after=True)
            ours = lambda: impl.linear_reduce_scatter_forward(x, w, None, bias_after=True, group=name)  # noqa: E731

        ref = nccl_gemm().clone()
        row["err"] = rel_err(ours(), ref)
        row["plan"] = plan_summary()
        fns = {"gemm": gemm, "coll": coll, "nccl+gemm": nccl_gemm}
        try:
            row["torch_err"] = rel_err(torch_fused(), ref)
            fns["torch"] = torch_fused
        except Exception as error:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
            row["torch"] = None
            row["torch_error"] = f"{type(error).__name__}: {error}"[:200]
        fns["ours"] = ours
        times, row["host"] = eager_interleaved(fns, host_of="ours")
        row.update(times)
        row["ours:graph"] = graph_us(ours)
        for column, forced in (("ours:1s", "off"), ("ours:2s", "on")):
            with opfuse.config.override(overlap_alternate_streams=forced):
                row[column] = eager_us(ours)
        for setting in chunk_settings:
            with opfuse.config.override(overlap_chunks=setting):
                reserve("all_gather_linear" if op == "AG+GEMM" else "linear_reduce_scatter", x, w, pg,
                        **({} if op == "AG+GEMM" else {"bias_after": True}))
                row[f"ours:c{setting}"] = eager_us(ours)
    return row


def worker(rank, world, cfg, out_path):
    from torch.distributed import _symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        enable(dist.group.WORLD.group_name)
    rows = []
    for m in cfg["ms"]:
        for op in ("AG+GEMM", "GEMM+RS"):
            rows.append(bench_case(rank, world, op, m, cfg["k"], cfg["ffn"] // world, cfg["chunks"]))
            torch.cuda.empty_cache()
            if rank == 0:
                common.progress(f"world {world}: M={m} {op} done")
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(rows, handle)


def fmt(v, digits=0):
    return "-" if v is None else f"{v:.{digits}f}"


def ratio(a, b):
    return "-" if a is None or b is None else f"{a / b:.3f}"


def table(rows, chunks) -> str:
    extra = [f"ours:c{c}" for c in chunks]
    head = (["world", "M", "op", "plan"] + COLUMNS + extra
            + ["ours/gemm", "target", "ours/nccl+gemm", "ours/torch", "graph/gemm", "err", "met"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        target = TARGETS.get((r["op"], r["M"]))
        over = r["ours"] / r["gemm"]
        met = (target is None or over <= target) and r["ours"] < r["nccl+gemm"] and (
            r["torch"] is None or r["ours"] < r["torch"]) and r["err"] < 1.6e-2
        cells = ([str(r["world"]), str(r["M"]), r["op"], r.get("plan", "-")] + [fmt(r.get(c)) for c in COLUMNS + extra]
                 + [ratio(r["ours"], r["gemm"]), "-" if target is None else f"<={target}",
                    ratio(r["ours"], r["nccl+gemm"]), ratio(r["ours"], r["torch"]),
                    ratio(r["ours:graph"], r["gemm"]), f"{r['err']:.1e}", "yes" if met else "NO"])
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"torch fused op failed at world {r['world']} M={r['M']} {r['op']}: {r['torch_error']}"
             for r in rows if r.get("torch_error")]
    return "\n".join(lines + notes)


def ratio_series(rows) -> dict:
    """The chart: opfuse / GEMM alone per world and op, against M."""
    series = {}
    for r in rows:
        label = f"world {r['world']} {r['op']}: opfuse / GEMM alone"
        series.setdefault(label, []).append((r["M"], r["ours"] / r["gemm"]))
    return series


def main() -> int:
    parser = common.parser("overlap", __doc__)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--m", type=int, nargs="+", default=[2048, 8192], help="tokens over all ranks")
    parser.add_argument("--k", type=int, default=8192, help="hidden size")
    parser.add_argument("--ffn", type=int, default=28672, help="FFN size over all ranks (N = ffn / world)")
    parser.add_argument("--chunks", type=int, nargs="*", default=[1, 2, 4],
                        help="extra OPFUSE_OVERLAP_CHUNKS settings timed for ours (tuning information)")
    args = parser.parse_args()

    def measure():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        measured = []
        for world in common.worlds(args.world):
            cfg = {"ms": args.m, "k": args.k, "ffn": args.ffn, "chunks": args.chunks}
            measured += common.run_ranks(worker, world, cfg, timeout=600)
            common.progress(f"world {world}: done")
        return measured

    rows = common.results(args, "overlap", min(args.world), measure)
    if rows is None:
        return 0
    chunks = sorted({int(k[6:]) for r in rows for k in r if k.startswith("ours:c")})
    print(f"\nComm + GEMM overlap, bf16, K={args.k}, N={args.ffn}/world; microseconds per call (eager, "
          f"batches of {CALLS}, median of {REPS}, max over ranks; ours:graph = CUDA graph)")
    print(table(rows, chunks))
    common.finish(args, rows, series=ratio_series(rows), xlabel="M (tokens over all ranks)",
                  ylabel="time ratio (1 = GEMM alone)", title="comm + GEMM overlap: opfuse / the GEMM alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
