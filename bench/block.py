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
import logging
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (bench/common.py)
from opfuse import ops  # noqa: E402
from timing import graph_replay_us  # noqa: E402  (bench/timing.py)
from opfuse.ops import collectives  # noqa: E402

EPS = 1e-6
EAGER_KEYS = ("nn", "compile", "opfuse", "graphed")
TARGETS = {"decode_nn": 0.7, "decode_compile": 0.85, "train_nn": 1.15, "train_compile": 1.0,
           "decode_floor": 1.08, "train_floor": 1.05}
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


# The torch baselines --------------------------------------------------------------------------------

def _wait(t):
    return torch.ops._c10d_functional.wait_tensor(t)


class _SumFn(torch.autograd.Function):  # "g": all-reduce forward, identity backward
    @staticmethod
    def forward(ctx, x, name):
        return _wait(torch.ops._c10d_functional.all_reduce(x.contiguous(), "sum", name))

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _CopyFn(torch.autograd.Function):  # "f": identity forward, all-reduce backward
    @staticmethod
    def forward(ctx, x, name):
        ctx.name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return _wait(torch.ops._c10d_functional.all_reduce(dy.contiguous(), "sum", ctx.name)), None


class _GatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, world, name):
        ctx.world, ctx.name = world, name
        return _wait(torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), world, name))

    @staticmethod
    def backward(ctx, dy):
        return _wait(torch.ops._c10d_functional.reduce_scatter_tensor(dy.contiguous(), "sum", ctx.world,
                                                                      ctx.name)), None, None


class _ScatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, world, name):
        ctx.world, ctx.name = world, name
        return _wait(torch.ops._c10d_functional.reduce_scatter_tensor(x.contiguous(), "sum", world, name))

    @staticmethod
    def backward(ctx, dy):
        return _wait(torch.ops._c10d_functional.all_gather_into_tensor(dy.contiguous(), ctx.world,
                                                                       ctx.name)), None, None


class TorchBlock(nn.Module):
    """The block in plain torch over the opfuse block's parameters. ``functional``: functional
    collectives (traceable by torch.compile); else torch.distributed's eager NCCL calls."""

    def __init__(self, block: ops.Sequential, act: str, sp: bool, functional: bool):
        super().__init__()
        self.n1 = block[0].weight
        if act == "gelu":
            self.w1, self.b1 = block[1].weight, block[1].bias
        else:  # separate gate and up projections, as Hugging Face's LlamaMLP runs them (two GEMMs)
            self.gate = (block[1].gate_weight, block[1].gate_bias)
            self.up = (block[1].up_weight, block[1].up_bias)
        self.w2, self.b2, self.n2 = block[3].weight, block[3].bias, block[6].weight
        self.act, self.sp, self.functional = act, sp, functional
        self.world, self.name = dist.get_world_size(), dist.group.WORLD.group_name

    def _comm(self, kind, x):
        if self.functional:
            if kind in ("gather", "scatter"):
                return (_GatherFn if kind == "gather" else _ScatterFn).apply(x, self.world, self.name)
            return (_CopyFn if kind == "copy" else _SumFn).apply(x, self.name)
        return {"gather": collectives.all_gather, "scatter": collectives.reduce_scatter,
                "copy": collectives.grad_all_reduce, "sum": collectives.all_reduce}[kind](x, None)

    def forward(self, x, res):
        hidden = x.shape[-1]
        h = self._comm("gather" if self.sp else "copy", F.rms_norm(x, (hidden,), self.n1, EPS))
        # Compiled: the bias as its own add, so Inductor's async-TP matcher sees a plain mm after the
        # all-gather (an addmm is not matched, and bf16 addmm stays fused in recent Inductor); the
        # add fuses into the activation kernel. Eager: what nn.Linear runs (addmm).
        linear = (lambda t, w, b: F.linear(t, w) + b) if self.functional else F.linear
        if self.act == "gelu":
            a = F.gelu(linear(h, self.w1, self.b1), approximate="tanh")
        else:
            a = F.silu(linear(h, *self.gate)) * linear(h, *self.up)
        r = self._comm("scatter" if self.sp else "sum", F.linear(a, self.w2)) + self.b2 + res
        return F.rms_norm(r, (hidden,), self.n2, EPS), r


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


# Async-TP accounting --------------------------------------------------------------------------------------

class AsyncTP:
    """Turns on Inductor's micro-pipeline TP and counts the collectives it fuses (by wrapping the
    post-grad pass; compile caches are bypassed while counting, else a cached graph skips it)."""

    def __init__(self):
        self.fused = {"all_gather+mm": 0, "mm+reduce_scatter": 0}
        self.candidates = {"all_gather": 0, "reduce_scatter": 0}
        self.note = None
        try:
            from torch.distributed import _symmetric_memory as symm_mem
            from torch._inductor import config as inductor_config
            from torch._inductor.fx_passes import micro_pipeline_tp, post_grad

            enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
            if enable is not None:
                enable(dist.group.WORLD.group_name)
            inductor_config._micro_pipeline_tp = True
            original = post_grad.micro_pipeline_tp_pass

            def counting(graph):
                try:  # the patterns the pass looks at (whether or not it then fuses them)
                    self.candidates["all_gather"] += len(micro_pipeline_tp.find_all_gather_patterns(graph))
                    self.candidates["reduce_scatter"] += len(micro_pipeline_tp.find_reduce_scatter_patterns(graph))
                except Exception:  # noqa: BLE001 - diagnostics only
                    pass
                original(graph)
                for node in graph.nodes:
                    name = str(node.target)
                    if "fused_all_gather_matmul" in name:
                        self.fused["all_gather+mm"] += 1
                    elif "fused_matmul_reduce_scatter" in name:
                        self.fused["mm+reduce_scatter"] += 1

            post_grad.micro_pipeline_tp_pass = counting
        except Exception as error:  # noqa: BLE001 - report, compile without it
            self.note = f"async TP unavailable: {type(error).__name__}: {error}"
        logging.getLogger("torch._inductor.fx_passes.micro_pipeline_tp").setLevel(logging.ERROR)

    @staticmethod
    def uncached():
        stack = contextlib.ExitStack()
        from torch._inductor import config as inductor_config

        stack.enter_context(inductor_config.patch(fx_graph_cache=False))
        try:
            from torch._functorch import config as functorch_config

            if hasattr(functorch_config, "enable_autograd_cache"):
                stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
        except Exception:  # noqa: BLE001
            pass
        return stack


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


# Tables ---------------------------------------------------------------------------------------------------

def fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def tables(world, result, opts) -> tuple[str, list]:
    rows = result["rows"]
    out = [f"\nworld {world}: hidden {opts['hidden']}, ffn {opts['ffn']}, {opts['act']}, bf16; microseconds per block "
           f"call (max over ranks); host = CPU time to issue one call"]
    summary = []
    decode = [r for r in rows if r["case"] == "decode"]
    if decode:
        out += ["", f"decode (forward only; graphs of {opts['calls_decode']} calls)",
                "| tokens | nn | nn:graph | compile | compile:graph | opfuse | opfuse:graph | graphed call | "
                "host nn | host opfuse | host graphed | opfuse:graph / nn:graph | / compile:graph | "
                "floor (GEMMs) | opfuse:graph / floor | graphed / floor | impls |",
                "|" + "---|" * 17]
        for r in decode:
            a, b = ratio(r.get("opfuse:graph"), r.get("nn:graph")), ratio(r.get("opfuse:graph"), r.get("compile:graph"))
            out.append(f"| {r['tokens']} | {fmt(r.get('nn'))} | {fmt(r.get('nn:graph'))} | {fmt(r.get('compile'))} | "
                       f"{fmt(r.get('compile:graph'))} | {fmt(r.get('opfuse'))} | {fmt(r.get('opfuse:graph'))} | "
                       f"{fmt(r.get('graphed'))} | {fmt(r.get('host:nn'))} | {fmt(r.get('host:opfuse'))} | "
                       f"{fmt(r.get('host:graphed'))} | {fmt(a, 2)} | {fmt(b, 2)} | {fmt(r.get('floor'))} | "
                       f"{fmt(ratio(r.get('opfuse:graph'), r.get('floor')), 2)} | "
                       f"{fmt(ratio(r.get('graphed'), r.get('floor')), 2)} | {r.get('impls', '')} |")
            for key, base, target in (("decode_nn", "nn:graph", TARGETS["decode_nn"]),
                                      ("decode_compile", "compile:graph", TARGETS["decode_compile"]),
                                      ("decode_floor", "floor", TARGETS["decode_floor"])):
                for what in ("opfuse:graph", "graphed"):
                    value = ratio(r.get(what), r.get(base))
                    summary.append((world, f"decode T={r['tokens']}", f"{what} / {base}", value, f"<= {target}",
                                    None if value is None else value <= target))
    train = [r for r in rows if r["case"].startswith("train")]
    if train:
        out += ["", f"train (forward + backward, grads of inputs and parameters; {opts['calls_train']} calls per batch)",
                "| mode | tokens | nn | nn:graph | compile | opfuse | graphed | host opfuse | host graphed | "
                "nn / opfuse | compile / opfuse | nn / graphed | floor (GEMMs) | opfuse / floor | graphed / floor | "
                "impls |",
                "|" + "---|" * 16]
        for r in train:
            out.append(f"| {r['case'][6:]} | {r['tokens']} | {fmt(r.get('nn'))} | {fmt(r.get('nn:graph'))} | "
                       f"{fmt(r.get('compile'))} | {fmt(r.get('opfuse'))} | {fmt(r.get('graphed'))} | "
                       f"{fmt(r.get('host:opfuse'))} | {fmt(r.get('host:graphed'))} | "
                       f"{fmt(ratio(r.get('nn'), r.get('opfuse')), 2)} | {fmt(ratio(r.get('compile'), r.get('opfuse')), 2)} | "
                       f"{fmt(ratio(r.get('nn'), r.get('graphed')), 2)} | {fmt(r.get('floor'))} | "
                       f"{fmt(ratio(r.get('opfuse'), r.get('floor')), 2)} | "
                       f"{fmt(ratio(r.get('graphed'), r.get('floor')), 2)} | {r.get('impls', '')} |")
            for what in ("opfuse", "graphed"):
                value = ratio(r.get(what), r.get("floor"))
                target = TARGETS["train_floor"]
                summary.append((world, f"{r['case']} T={r['tokens']}", f"{what} / floor", value, f"<= {target}",
                                None if value is None else value <= target))
                value = ratio(r.get("nn"), r.get(what))
                summary.append((world, f"{r['case']} T={r['tokens']}", f"nn / {what} (speedup)", value,
                                f">= {TARGETS['train_nn']}", None if value is None else value >= TARGETS["train_nn"]))
                value = ratio(r.get("compile"), r.get(what))
                summary.append((world, f"{r['case']} T={r['tokens']}", f"compile / {what} (speedup)", value,
                                f">= {TARGETS['train_compile']}",
                                None if value is None else value >= TARGETS["train_compile"]))
    errs = "; ".join(f"{r['case']} T={r['tokens']}: " + ", ".join(f"{k} {v:.1e}" for k, v in r.get("err", {}).items()
                                                                    if v is not None) for r in rows)
    out += ["", f"relative error vs torch.nn (outputs; train: max over outputs' grads): {errs}"]
    out += [f"note: {n}" for n in result["notes"]]
    out.append(f"(world {world} took {result['seconds']:.0f} s in the ranks)")
    return "\n".join(out), summary


def ratio_series(results) -> dict:
    """The chart: opfuse / torch.nn per world and case against tokens (decode: both as CUDA graphs;
    train: eager forward + backward)."""
    series = {}
    for world, result in results.items():
        for r in result["rows"]:
            ours, base = ("opfuse:graph", "nn:graph") if r["case"] == "decode" else ("opfuse", "nn")
            value = ratio(r.get(ours), r.get(base))
            if value is not None:
                series.setdefault(f"world {world} {r['case']}: {ours} / {base}", []).append((r["tokens"], value))
    return series


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
