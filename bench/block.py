"""Whole tensor-parallel MLP block: opfuse (eager and graphed) against torch.nn + NCCL (eager and
under CUDA graphs) and torch.compile (async TP where torch supports it), in one run.

    PYTHONPATH=. python3 bench/block.py --world 2 4            # hidden 8192, ffn 28672, bf16
    PYTHONPATH=. python3 bench/block.py --world 2 --quick      # small sizes, a smoke test
    python3 bench/block.py --world 2 --cpu                      # CPU/gloo dry run of the code paths

The block (as ``python -m opfuse demo``): RMSNorm -> column Linear -> GELU(tanh) (or ``--act swiglu``:
column GatedLinear, separate gate and up weights; torch baselines run the two GEMMs as Hugging Face's
LlamaMLP does, opfuse one) -> row Linear (+ bias) -> + residual -> RMSNorm, returning ``(y, new_residual)``. Every variant uses the
same parameter tensors (the opfuse block's), same inputs, same output gradients.

Cases:
  decode    1, 16, 64 tokens; forward only (torch.no_grad); tensor-parallel (tokens replicated)
  train     2048, 8192 tokens; forward + backward (grads of inputs and every parameter, through
            torch.autograd.grad with fixed random output gradients, i.e. loss = sum(outputs * g));
            tensor-parallel (``tp``) and sequence-parallel (``sp``: tokens sharded, all-gather /
            reduce-scatter around the GEMMs)

Variants:
  nn          nn.Linear-style shards (F.linear) + torch.distributed NCCL collectives (Megatron f/g
              autograd functions) + F.rms_norm / F.gelu, eager
  nn:graph    the same, CUDA graph of CALLS back-to-back calls (forward and backward captured)
  compile     the same math under torch.compile (functional collectives; Inductor micro-pipeline
              async TP enabled: it fuses all-gather+mm and mm+reduce-scatter in the sp case),
              eager launches; ``compile:graph`` (decode): its CUDA graph of CALLS calls
  opfuse      the block as ops.Sequential, eager
  opfuse:graph  (decode) CUDA graph of CALLS back-to-back block calls (pure GPU time, the method
              used for the torch graphs)
  graphed     opfuse.graphed(block, ...): CALLS back-to-back calls of the graphed module (each
              copies its inputs into the static buffers and replays; forward+backward graphs in train)
  host:*      host (CPU) time per call while issuing CALLS calls, for the eager variants and graphed

Method: CUDA events; graphs: median of REPS replays of a graph of CALLS calls; eager and graphed:
median of REPS batches of CALLS back-to-back calls after a warm-up; every batch/replay starts after
a barrier; max over ranks (CALLS = 20 decode / 3 train, REPS = 7 / 5). NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1. torch.compile uses static shapes (one compile per size; the sp
compiles bypass Inductor's caches so the async-TP pass runs and can be counted): compiling is most
of the ~3-4 minutes of a full run. ``--skip compile`` / ``--no-train-8192`` shorten it,
``--act swiglu`` runs the SwiGLU block, ``--json FILE`` keeps every row, ``--plot FILE.png`` draws
opfuse / torch.nn against tokens, ``--from-json FILE`` prints and plots a saved run without GPUs.

Floor (issue 15), measured in the same run: the block's GEMMs alone on this GPU at the per-rank
shapes (column GEMM [T, hidden] x [hidden, width/world], row GEMM [T, ffn/world] x [ffn/world,
hidden]; train: plus both layers' data- and weight-gradient GEMMs), as a CUDA graph of the same
number of calls; decode streams the weights from HBM on every call (they exceed L2). Sequence
parallelism gathers the tokens before the GEMMs, so tp and sp share one floor. ``floor`` columns
print opfuse / floor next to the peer ratios.

Targets (issue 8): decode, graphed: opfuse <= 0.7x torch.nn+NCCL graphed and <= 0.85x
torch.compile graphed; train: >= 1.15x faster than torch.nn+NCCL eager and no slower than
torch.compile (async TP). Issue 15: decode (graphed) <= 1.08x and train <= 1.05x of the floor.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (bench/common.py)
from block_baselines import EPS, AsyncTP, TorchBlock  # noqa: E402  (bench/block_baselines.py)
from block_report import fmt, ratio_series, tables  # noqa: E402  (bench/block_report.py)
from opfuse import ops  # noqa: E402
from timing import graph_replay_us  # noqa: E402  (bench/timing.py)

EAGER_KEYS = ("nn", "compile", "opfuse", "graphed")
FULL = dict(hidden=8192, ffn=28672, decode=[1, 16, 64], train=[2048, 8192], calls_decode=20, calls_train=3,
            reps=7, reps_train=5)
QUICK = dict(hidden=1024, ffn=4096, decode=[1, 16], train=[512], calls_decode=10, calls_train=3, reps=5,
             reps_train=3)
# --cpu: the same code paths on gloo and CPU tensors (graphs replaced by eager calls, opfuse.graphed
# by its replay="eager" mode); checks the bench itself, its timings mean nothing.
CPU = dict(hidden=64, ffn=256, decode=[1, 4], train=[8], calls_decode=2, calls_train=2, reps=2, reps_train=2)
DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def opfuse_block(hidden, ffn, act, sp):
    kw = dict(dtype=torch.bfloat16, device=DEVICE)
    if act == "gelu":
        first = [ops.Linear(hidden, ffn, parallel="column", sequence_parallel=sp, **kw), ops.GELU("tanh")]
    else:  # the activation is part of the gated layer; Identity keeps the op indices of the GELU block
        first = [ops.GatedLinear(hidden, ffn, bias=True, parallel="column", sequence_parallel=sp, **kw), ops.Identity()]
    return ops.Sequential(
        ops.RMSNorm(hidden, eps=EPS, **kw),
        *first,
        ops.Linear(ffn, hidden, parallel="row", sequence_parallel=sp, **kw),
        ops.AddExtraInput(), ops.MakeExtraOutput(),
        ops.RMSNorm(hidden, eps=EPS, **kw))


# Timing ------------------------------------------------------------------------------------------------

def _max_over_ranks(values):
    t = torch.tensor([float("nan") if v is None else v for v in values], device=DEVICE, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [None if v != v else v for v in t.tolist()]


def eager_us(fn, calls, reps):
    """(GPU-side wall time, host issue time) per call in microseconds, medians over ``reps`` batches."""
    for _ in range(2):
        fn()
    gpu, host = [], []
    for _ in range(reps):
        dist.barrier()
        sync()
        if DEVICE != "cuda":
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            gpu.append((time.perf_counter() - t0) * 1e6 / calls)
            host.append(gpu[-1])
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1000.0 / calls)
        host.append((t1 - t0) * 1e6 / calls)
    return statistics.median(gpu), statistics.median(host)


def graph_us(fn, calls, reps):
    """Per call, median over ``reps`` replays of one CUDA graph of ``calls`` calls of ``fn``."""
    if DEVICE != "cuda":
        return eager_us(fn, calls, reps)[0]
    return statistics.median(graph_replay_us(fn, calls, reps))


def gemm_floor_us(hidden, ffn, act, world, tokens, train, calls, reps):
    """The block's GEMMs alone at one rank's shapes, per block call (see the module docstring)."""
    width = (ffn if act == "gelu" else 2 * ffn) // world
    gen = torch.Generator(device=DEVICE).manual_seed(11)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE).to(torch.bfloat16)

    w1, w2 = randn(width, hidden), randn(hidden, ffn // world)
    x, a = randn(tokens, hidden), randn(tokens, ffn // world)
    if not train:
        def gemms():
            torch.mm(x, w1.t())
            torch.mm(a, w2.t())
    else:
        dy, da = randn(tokens, hidden), randn(tokens, width)

        def gemms():
            torch.mm(x, w1.t())    # column layer forward
            torch.mm(a, w2.t())    # row layer forward
            torch.mm(dy, w2)       # row layer: input gradient
            torch.mm(dy.t(), a)    # row layer: weight gradient
            torch.mm(da, w1)       # column layer: input gradient
            torch.mm(da.t(), x)    # column layer: weight gradient
    return graph_us(gemms, calls, reps)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# The worker ---------------------------------------------------------------------------------------------

def worker(rank, world, opts, out_path):
    import opfuse
    from opfuse.graphs import graphed as graphed_fn

    global DEVICE
    DEVICE = opts["device"]
    replay = "cuda_graph" if DEVICE == "cuda" else "eager"

    def graphed(*args):
        return graphed_fn(*args, replay=replay)

    warnings.filterwarnings("ignore")
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    async_tp = AsyncTP()
    calls_d, calls_t, reps, reps_t = opts["calls_decode"], opts["calls_train"], opts["reps"], opts["reps_train"]
    hidden, ffn, act = opts["hidden"], opts["ffn"], opts["act"]
    rows, notes = [], []
    t_start = time.perf_counter()

    def measure(row, key, thunk):
        try:
            return thunk()
        except Exception as error:  # noqa: BLE001
            text = f"{row['case']} T={row['tokens']} {key}: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
            if rank == 0:
                print("  failed:", text, flush=True)
            notes.append(text)
            sync()
            return None

    def attempt(row, key, thunk):
        """Run one measurement; a failure (the same on every rank) becomes a note, not an abort."""
        if opts["skip"] and any(key.startswith(s) for s in opts["skip"]):
            value = None
        else:
            value = measure(row, key, thunk)
        if isinstance(value, tuple):
            row[key], row["host:" + key] = value
        else:
            row[key] = value
            if key in EAGER_KEYS:  # every rank must hold the same keys (they are reduced together)
                row["host:" + key] = None

    floors = {}

    def floor(tokens, train, calls, reps):
        """The GEMM floor, measured once per shape (tp and sp share it)."""
        if (tokens, train) not in floors:
            floors[tokens, train] = gemm_floor_us(hidden, ffn, act, world, tokens, train, calls, reps)
        return floors[tokens, train]

    for sp in (False, True):
        torch.manual_seed(1234)  # the same parameters on every rank (replicated ones must agree)
        block = opfuse_block(hidden, ffn, act, sp)
        with torch.no_grad():
            for norm in (block[0], block[6]):
                norm.weight.copy_(1 + 0.1 * torch.randn_like(norm.weight))
            for name, param in (*block[1].named_parameters(), *block[3].named_parameters()):
                if "bias" in name:
                    param.copy_(0.1 * torch.randn_like(param))
        eager_nn = TorchBlock(block, act, sp, functional=False)
        compiled = torch.compile(TorchBlock(block, act, sp, functional=True), dynamic=False)
        params = list(block.parameters())
        cases = ([] if sp else [("decode", t) for t in opts["decode"]]) + [("train", t) for t in opts["train"]]
        for case, tokens in cases:
            local = tokens // world if sp else tokens
            label = "sp" if sp else "tp"
            row = {"case": case if case == "decode" else f"train-{label}", "tokens": tokens, "local_tokens": local}
            gen = torch.Generator(device=DEVICE).manual_seed(7 + (rank if sp else 0))
            randn = lambda: torch.randn(local, hidden, generator=gen, device=DEVICE).to(torch.bfloat16)  # noqa: E731
            x, res, gy, gh = randn(), randn(), randn(), randn()
            if case == "decode":
                with torch.no_grad():
                    ref = eager_nn(x, res)
                    outs = {"opfuse": block(x, res)}
                    outs["compile"] = measure(row, "compile (first call)", lambda: compiled(x, res))
                    if outs["compile"] is None:
                        del outs["compile"]
                    row["impls"] = ", ".join(f"{f.rule}={f.impl}" for f in opfuse.compile(block, x, res).fusions)
                    row["err"] = {k: rel(v[0], ref[0]) for k, v in outs.items()}
                    attempt(row, "nn", lambda: eager_us(lambda: eager_nn(x, res), calls_d, reps))
                    attempt(row, "nn:graph", lambda: graph_us(lambda: eager_nn(x, res), calls_d, reps))
                    ok = "compile" in outs
                    attempt(row, "compile", lambda: eager_us(lambda: compiled(x, res), calls_d, reps) if ok else None)
                    attempt(row, "compile:graph", lambda: graph_us(lambda: compiled(x, res), calls_d, reps) if ok else None)
                    attempt(row, "opfuse", lambda: eager_us(lambda: block(x, res), calls_d, reps))
                    attempt(row, "opfuse:graph", lambda: graph_us(lambda: block(x, res), calls_d, reps))

                    def graphed_time():
                        step = graphed(block, x, res)
                        got = step(x, res)
                        row["err"]["graphed"] = rel(got[0], ref[0])
                        value = eager_us(lambda: step(x, res), calls_d, reps)
                        del step
                        return value

                    attempt(row, "graphed", graphed_time)
                    attempt(row, "floor", lambda: floor(tokens, False, calls_d, reps))
            else:
                xl, rl = x.clone().requires_grad_(), res.clone().requires_grad_()
                leaves = [xl, rl] + params

                def train_step(fn):
                    return lambda: torch.autograd.grad(fn(xl, rl), leaves, (gy, gh))

                ref = train_step(eager_nn)()
                checks = {"opfuse": train_step(block)}

                def first_compile():
                    with async_tp.uncached() if sp else contextlib.nullcontext():
                        checks["compile"] = train_step(compiled)
                        return checks["compile"]()

                if measure(row, "compile (first call)", first_compile) is None:
                    checks.pop("compile", None)
                row["impls"] = ", ".join(f"{f.rule}={f.impl}" for f in opfuse.compile(block, xl, rl).fusions)
                row["err"] = {}
                for name, fn in checks.items():
                    got = fn()
                    row["err"][name] = max(rel(a, b) for a, b in zip(got, ref))
                attempt(row, "nn", lambda: eager_us(train_step(eager_nn), calls_t, reps_t))
                attempt(row, "nn:graph", lambda: graph_us(train_step(eager_nn), calls_t, reps_t))
                attempt(row, "compile",
                        lambda: eager_us(checks["compile"], calls_t, reps_t) if "compile" in checks else None)
                attempt(row, "opfuse", lambda: eager_us(train_step(block), calls_t, reps_t))

                def graphed_time():
                    step = graphed(block, xl, rl)
                    got = torch.autograd.grad(step(xl, rl), leaves, (gy, gh))
                    row["err"]["graphed"] = max(rel(a, b) for a, b in zip(got, ref))
                    value = eager_us(train_step(step), calls_t, reps_t)
                    del step
                    return value

                attempt(row, "graphed", graphed_time)
                attempt(row, "floor", lambda: floor(tokens, True, calls_t, reps_t))
                del ref, checks
            keys = [k for k in row if k.split(":")[0] in ("nn", "compile", "opfuse", "graphed", "host", "floor")]
            for key, value in zip(keys, _max_over_ranks([row[k] for k in keys])):
                row[key] = value
            errs = _max_over_ranks(list(row["err"].values()))
            row["err"] = dict(zip(row["err"], errs))
            rows.append(row)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            if rank == 0:
                common.progress(f"world {world} {row['case']} T={tokens}: done")
        block = eager_nn = compiled = None  # free before the next mode
        torch._dynamo.reset()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    if async_tp.note:
        notes.append(async_tp.note)
    notes.append(f"async TP (Inductor micro-pipeline TP) over the compiled graphs: collectives it matched "
                 f"{async_tp.candidates}, fused into symm_mem ops {async_tp.fused} (sp: forward + backward graphs)")
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump({"rows": rows, "notes": notes, "seconds": time.perf_counter() - t_start}, handle)


def main() -> int:
    parser = common.parser("block", __doc__)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--quick", action="store_true", help="small sizes (hidden 1024, ffn 4096): a smoke test")
    parser.add_argument("--cpu", action="store_true", help="gloo + CPU dry run of the code paths (no timings)")
    parser.add_argument("--act", choices=["gelu", "swiglu"], default="gelu")
    parser.add_argument("--no-train-8192", action="store_true", help="drop the 8192-token training case")
    parser.add_argument("--skip", nargs="*", default=[], help="variants to skip, e.g. compile nn:graph")
    args = parser.parse_args()
    results, summary, started = {}, [], time.perf_counter()
    if args.from_json:
        saved = common.load_json(args.from_json)
        opts, results = saved["opts"], saved["results"]
        for world, result in results.items():
            text, rows = tables(world, result, opts)
            summary += rows
            print(text, flush=True)
    else:
        if not args.cpu and common.skip_without_gpus("block", min(args.world)):
            return 0
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        opts = dict(CPU if args.cpu else QUICK if args.quick else FULL, act=args.act, skip=args.skip,
                    device="cpu" if args.cpu else "cuda")
        if args.no_train_8192:
            opts["train"] = [t for t in opts["train"] if t != 8192]
        for world in args.world if args.cpu else common.worlds(args.world):
            results[str(world)] = common.run_ranks(worker, world, opts, backend="gloo" if args.cpu else "nccl")
            text, rows = tables(world, results[str(world)], opts)
            summary += rows
            print(text, flush=True)
    if args.cpu:
        print("\n(--cpu: a dry run of the code paths on gloo; the timings below mean nothing)")
    print(f"\nsummary (targets of issues 8 and 15; ratios within one run; {time.perf_counter() - started:.0f} s in all)")
    print("| world | case | ratio | value | target | met |\n|---|---|---|---|---|---|")
    for world, case, what, value, target, met in summary:
        print(f"| {world} | {case} | {what} | {fmt(value, 2)} | {target} | {'-' if met is None else ('yes' if met else 'NO')} |")
    common.finish(args, {"opts": opts, "results": results}, series=ratio_series(results), xlabel="tokens",
                  ylabel="time ratio (< 1: opfuse faster)", title="tensor-parallel MLP block: opfuse / torch.nn + NCCL")
    return 0


if __name__ == "__main__":
    sys.exit(main())
