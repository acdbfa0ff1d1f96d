"""Whole model: the Llama-style decoder of examples/llama_tp.py at a realistic size, tensor-parallel,
compiled by opfuse's torch.compile backend, against torch.compile (Inductor; async TP where it
applies) and eager, in one run.

    PYTHONPATH=. python3 bench/model.py --world 2 4          # hidden 8192, 64 heads (8 kv), ffn 28672, 2 layers
    PYTHONPATH=. python3 bench/model.py --world 2 --layers 4 # more layers (compiling dominates the run time)
    PYTHONPATH=. python3 bench/model.py --world 2 --quick    # hidden 1024, 2 layers: a smoke test
    PYTHONPATH=. python3 bench/model.py --world 2 --decode 1 64 --train 2048   # fewer compiles
    python3 bench/model.py --world 2 --cpu                    # gloo + CPU dry run of the code paths
    PYTHONPATH=. python3 bench/model.py --world 2 --decode --fp8 tensor   # FP8 training (issue 27)

The model is the example's (F.scaled_dot_product_attention, rotary, SwiGLU MLP, hand-written
float32 RMSNorm), bf16, vocabulary 4096 (the decoder is what is measured), the same weights in
every variant (same seed).

Cases:
  decode   T = 1, 16, 64 sequences of one new token each (batch T, sequence 1, no KV cache: the
           GEMMs, all-reduces and norms of a decode step); forward only; tensor parallelism with
           torch.distributed all-reduces (``--tp dist`` of the example)
  train    2048 and 8192 tokens (batch 1), forward + backward (gradients of every parameter,
           loss = sum(logits * g) for a fixed random g): ``tp`` (torch.distributed all-reduces) and
           ``sp`` (DTensor with sequence parallelism, torchtitan's plan; Inductor's async TP on)

Variants:
  eager            the model as written, eager (``eager:graph``, decode: a CUDA graph of it)
  compile          torch.compile (Inductor); decode with mode="reduce-overhead" (CUDA graphs)
  opfuse           opfuse.optimize (this backend); decode with mode="reduce-overhead"
  compile s / opfuse s   the first call's wall time (compilation; Inductor's caches off for both)

Method: CUDA events; medians of REPS batches of CALLS back-to-back calls after warm-up, every
batch after a barrier, max over ranks (CALLS = 20 decode / 3 train, REPS = 7 / 5).
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1. Every size is its own static-shape
compile (14 per world, 10 with --no-train-8192): compiling is most of the run time.

Targets (issue 14): decode opfuse <= 0.85x compile at world 2; train opfuse <= 1.0x compile with
async TP (sp), and faster where the overlaps win; compile time opfuse <= 1.5x compile.

Merged projections (issue 27, ``--merge-ab``): decode also with ``opfuse.optimize(merge_projections=False)``;
target: merged <= 0.97x unmerged.

FP8 (issue 27, ``--fp8 tensor|row``; bench/fp8_variants.py): the training cases' opfuse variant
runs ``opfuse.optimize(fp8=recipe)`` (output head in bf16) and a ``torchao`` column (torchao float8
+ torch.compile, same recipe and filter; ``tp`` cases, when torchao imports) is added. Targets:
train opfuse fp8 <= 0.75x compile (bf16) and <= 0.92x torchao.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import block  # noqa: E402  (bench/block.py: timing helpers and Inductor's async-TP switch)
import common  # noqa: E402  (bench/common.py)
import fp8_variants  # noqa: E402  (bench/fp8_variants.py: --fp8, issue 27)
import llama_tp  # noqa: E402  (examples/llama_tp.py: the model)

TARGETS = {"decode": 0.85, "train": 1.0, "compile_time": 1.5}
MODEL = dict(dim=8192, layers=2, heads=64, kv_heads=8, ffn=28672, vocab=4096, max_seq=8192)
FULL = dict(model=MODEL, decode=[1, 16, 64], train=[2048, 8192], calls_decode=20, calls_train=3, reps=7,
            reps_train=5)
QUICK = dict(model=dict(MODEL, dim=1024, layers=2, heads=16, kv_heads=4, ffn=4096), decode=[1, 16], train=[512],
             calls_decode=10, calls_train=3, reps=5, reps_train=3)
# --cpu: the code paths on gloo with CPU tensors; fused graphs run eagerly (no Inductor on two
# cores), torch.compile is aot_eager with Inductor's decompositions. Its timings mean nothing.
CPU = dict(model=dict(MODEL, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=96, max_seq=64), decode=[1, 4],
           train=[16], calls_decode=2, calls_train=2, reps=2, reps_train=2)
VARIANTS = ("eager", "eager:graph", "compile", "opfuse")


def _compilers(device: str, decode: bool, fp8: str | None = None):
    """``(torch.compile variant, opfuse variant)`` as functions of a model (``fp8``: the opfuse
    variant's recipe, ``--fp8``; bench/fp8_variants.py)."""
    import opfuse

    fp8_kw = dict(fp8=fp8_variants.recipe(fp8), fp8_filter=fp8_variants.keep_high_precision) if fp8 else {}
    if device != "cuda":
        return (lambda m: torch.compile(m, backend="aot_eager_decomp_partition", dynamic=False),
                lambda m: opfuse.optimize(m, options={"inductor": False}, **fp8_kw))
    mode = "reduce-overhead" if decode else None
    return (lambda m: torch.compile(m, mode=mode, dynamic=False), lambda m: opfuse.optimize(m, mode=mode, **fp8_kw))


def _unmerged(device: str):
    """--merge-ab (issue 27): the decode opfuse variant with ``merge_projections=False``."""
    import opfuse

    if device != "cuda":
        return lambda m: opfuse.optimize(m, merge_projections=False, options={"inductor": False})
    return lambda m: opfuse.optimize(m, merge_projections=False, mode="reduce-overhead")


def _uncached():
    stack = contextlib.ExitStack()
    try:
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config

        stack.enter_context(inductor_config.patch(fx_graph_cache=False))
        if hasattr(functorch_config, "enable_autograd_cache"):
            stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
    except Exception:  # noqa: BLE001 - a torch without these switches compiles as it does
        pass
    return stack


def _first_call(fn):
    """``fn()``'s result and its wall time in seconds (the compilation, for a compiled model)."""
    block.sync()
    dist.barrier()
    start = time.perf_counter()
    with _uncached():
        out = fn()
    block.sync()
    return out, time.perf_counter() - start


def _fusions(compiled) -> str:
    import opfuse

    counts: dict[str, int] = {}
    for program in opfuse.programs(compiled):
        for record in program.fusions:
            key = f"{record.rule}({program.phases.get(record.fused_node, '?')[0]})={record.impl}"
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n}x {k}" for k, n in sorted(counts.items()))


def worker(rank, world, opts, out_path):
    import json

    warnings.filterwarnings("ignore")
    device = opts["device"]
    block.DEVICE = device
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    cfg = llama_tp.Config(**opts["model"])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows, notes, started = [], [], time.perf_counter()

    def measured(row, key, thunk):
        try:
            row[key] = thunk()
        except Exception as error:  # noqa: BLE001 - the same failure on every rank: a note, not an abort
            notes.append(f"{row['case']} T={row['tokens']} {key}: {type(error).__name__}: "
                         f"{str(error).splitlines()[0][:160] if str(error) else ''}")
            row[key] = None
            block.sync()

    def finish(row):
        keys = [k for k in row if k not in ("case", "tokens", "fusions", "err")]  # the same on every rank
        for key, value in zip(keys, block._max_over_ranks([row[k] for k in keys])):
            row[key] = value
        row["err"] = dict(zip(row["err"], block._max_over_ranks(list(row["err"].values()))))
        rows.append(row)
        torch._dynamo.reset()
        if device == "cuda":
            torch.cuda.empty_cache()
        if rank == 0:
            common.progress(f"world {world} {row['case']} T={row['tokens']}: done")

    # Decode: one model per variant (same seed, same weights), each compiled once per size.
    compile_fn, opfuse_fn = _compilers(device, decode=True)
    for tokens in opts["decode"]:
        models = {v: llama_tp.build("dist", rank, world, cfg, dtype, device) for v in ("eager", "compile", "opfuse")}
        ids = torch.randint(0, cfg.vocab, (tokens, 1), generator=torch.Generator().manual_seed(3)).to(device)
        row = {"case": "decode", "tokens": tokens}
        with torch.no_grad():
            want = models["eager"](ids)
            compiled = {"compile": compile_fn(models["compile"]), "opfuse": opfuse_fn(models["opfuse"])}
            if opts.get("merge_ab"):  # issue 27: the same without merged projections
                models["opfuse unmerged"] = llama_tp.build("dist", rank, world, cfg, dtype, device)
                compiled["opfuse unmerged"] = _unmerged(device)(models["opfuse unmerged"])
            errors = {}
            for name, fn in compiled.items():
                out, row[f"{name} s"] = _first_call(lambda fn=fn: fn(ids))
                errors[name] = block.rel(out.float(), want.float())
            calls, reps = opts["calls_decode"], opts["reps"]
            measured(row, "eager", lambda: block.eager_us(lambda: models["eager"](ids), calls, reps)[0])
            measured(row, "eager:graph", lambda: block.graph_us(lambda: models["eager"](ids), calls, reps))
            for name, fn in compiled.items():
                measured(row, name, lambda fn=fn: block.eager_us(lambda: fn(ids), calls, reps)[0])
        row["fusions"] = _fusions(compiled["opfuse"])
        row["err"] = errors
        models = compiled = None  # free before the next size
        finish(row)

    # Training: tp (torch.distributed all-reduces), sp (DTensor sequence parallel, async TP on).
    compile_fn, opfuse_fn = _compilers(device, decode=False, fp8=opts.get("fp8"))
    torchao_fn, torchao_note = fp8_variants.torchao_compiler(opts.get("fp8"))  # --fp8: a torchao column
    if opts.get("fp8"):
        notes.append(f"--fp8 {opts['fp8']}: the training cases' opfuse variant runs FP8; torchao column: "
                     f"{torchao_note}")
    async_tp = None
    for mode in ("tp", "sp"):
        if mode == "sp" and device == "cuda":
            async_tp = block.AsyncTP()  # Inductor's micro-pipeline TP for the torch.compile baseline (and opfuse's)
        tp = "dist" if mode == "tp" else "dtensor-sp"
        for tokens in opts["train"]:
            models = {v: llama_tp.build(tp, rank, world, cfg, dtype, device) for v in ("eager", "compile", "opfuse")}
            ids = torch.randint(0, cfg.vocab, (1, tokens), generator=torch.Generator().manual_seed(4)).to(device)
            grad = torch.randn(1, tokens, cfg.vocab, generator=torch.Generator().manual_seed(5)).to(device, dtype)
            row = {"case": f"train-{mode}", "tokens": tokens}
            steps = {"eager": models["eager"], "compile": compile_fn(models["compile"]),
                     "opfuse": opfuse_fn(models["opfuse"])}
            extra = ("torchao",) if torchao_fn is not None and mode == "tp" else ()  # --fp8 (issue 27)
            for name in extra:
                models[name] = llama_tp.build(tp, rank, world, cfg, dtype, device)
                steps[name] = torchao_fn(models[name])

            def step(name):
                params = [p for p in models[name].parameters() if p.requires_grad]
                return lambda: torch.autograd.grad(steps[name](ids), params, grad)

            want = step("eager")()
            errors = {}
            for name in ("compile", "opfuse") + extra:
                got, row[f"{name} s"] = _first_call(step(name))
                errors[name] = max(block.rel(a.float(), b.float()) for a, b in zip(_local(got), _local(want)))
            calls, reps = opts["calls_train"], opts["reps_train"]
            for name in ("eager", "compile", "opfuse") + extra:
                measured(row, name, lambda name=name: block.eager_us(step(name), calls, reps)[0])
            row["fusions"] = _fusions(steps["opfuse"])
            row["err"] = errors
            models = steps = want = None  # free before the next size
            finish(row)
    if async_tp is not None:
        notes.append(f"async TP (Inductor micro-pipeline TP, sp graphs): matched {async_tp.candidates}, fused "
                     f"{async_tp.fused}")
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump({"rows": rows, "notes": notes, "seconds": time.perf_counter() - started}, handle)


def _local(tensors):
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


# Tables ---------------------------------------------------------------------------------------------------


def tables(world, result, opts) -> tuple[str, list]:
    fmt, ratio = block.fmt, block.ratio
    model = opts["model"]
    out = [f"\nworld {world}: hidden {model['dim']}, {model['heads']} heads ({model['kv_heads']} kv), ffn "
           f"{model['ffn']}, {model['layers']} layers, {'bf16' if opts['device'] == 'cuda' else 'float32'}; "
           f"microseconds per step (max over ranks); compile: seconds of the first call"]
    out += ["| case | tokens | eager | eager:graph | compile | opfuse | opfuse / compile | opfuse / eager | "
            "compile s | opfuse s | opfuse s / compile s | fusions |", "|" + "---|" * 12]
    summary = []
    for r in result["rows"]:
        speed = ratio(r.get("opfuse"), r.get("compile"))
        compile_ratio = ratio(r.get("opfuse s"), r.get("compile s"))
        out.append(f"| {r['case']} | {r['tokens']} | {fmt(r.get('eager'))} | {fmt(r.get('eager:graph'))} | "
                   f"{fmt(r.get('compile'))} | {fmt(r.get('opfuse'))} | {fmt(speed, 2)} | "
                   f"{fmt(ratio(r.get('opfuse'), r.get('eager')), 2)} | {fmt(r.get('compile s'))} | "
                   f"{fmt(r.get('opfuse s'))} | {fmt(compile_ratio, 2)} | {r.get('fusions', '')} |")
        target = TARGETS["decode"] if r["case"] == "decode" else TARGETS["train"]
        if r["case"] != "decode" or str(world) == "2":
            summary.append((world, f"{r['case']} T={r['tokens']}", "opfuse / compile", speed, f"<= {target}",
                            None if speed is None else speed <= target))
        summary.append((world, f"{r['case']} T={r['tokens']}", "opfuse s / compile s", compile_ratio,
                        f"<= {TARGETS['compile_time']}",
                        None if compile_ratio is None else compile_ratio <= TARGETS["compile_time"]))
    summary += _fp8_summary(world, result, opts)  # --fp8 (issue 27)
    for r in result["rows"]:  # --merge-ab (issue 27): merged q/k/v and gate/up vs not, decode
        merged = ratio(r.get("opfuse"), r.get("opfuse unmerged"))
        if merged is not None:
            summary.append((world, f"{r['case']} T={r['tokens']} (unmerged {block.fmt(r['opfuse unmerged'])} us)",
                            "opfuse / opfuse unmerged", merged, "<= 0.97", merged <= 0.97))
    errs = "; ".join(f"{r['case']} T={r['tokens']}: " + ", ".join(f"{k} {v:.1e}" for k, v in r.get("err", {}).items()
                                                                    if v is not None) for r in result["rows"])
    out += ["", f"relative error vs eager (outputs; train: max over gradients): {errs}"]
    out += [f"note: {n}" for n in result["notes"]]
    out.append(f"(world {world} took {result['seconds']:.0f} s in the ranks)")
    return "\n".join(out), summary


def _fp8_summary(world, result, opts) -> list:
    """--fp8 (issue 27): the torchao column's times and the FP8 targets of the training cases."""
    if not opts.get("fp8"):
        return []
    ratio, rows = block.ratio, []
    for r in result["rows"]:
        if not r["case"].startswith("train"):
            continue
        vs_compile = ratio(r.get("opfuse"), r.get("compile"))
        rows.append((world, f"{r['case']} T={r['tokens']} fp8 {opts['fp8']}", "opfuse fp8 / compile bf16", vs_compile,
                     "<= 0.75", None if vs_compile is None else vs_compile <= 0.75))
        if "torchao" in r:
            vs_torchao = ratio(r.get("opfuse"), r.get("torchao"))
            rows.append((world, f"{r['case']} T={r['tokens']} fp8 {opts['fp8']} (torchao {block.fmt(r['torchao'])} us)",
                         "opfuse fp8 / torchao fp8", vs_torchao, "<= 0.92",
                         None if vs_torchao is None else vs_torchao <= 0.92))
    return rows


def ratio_series(results) -> dict:
    series: dict = {}
    for world, result in results.items():
        for r in result["rows"]:
            value = block.ratio(r.get("opfuse"), r.get("compile"))
            if value is not None:
                series.setdefault(f"world {world} {r['case']}: opfuse / compile", []).append((r["tokens"], value))
    return series


def main() -> int:
    parser = common.parser("model", __doc__)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--quick", action="store_true", help="hidden 1024, 2 layers: a smoke test")
    parser.add_argument("--cpu", action="store_true", help="gloo + CPU dry run of the code paths (no timings)")
    parser.add_argument("--no-train-8192", action="store_true", help="drop the 8192-token training cases")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: 2; --cpu/--quick: 2)")
    parser.add_argument("--decode", type=int, nargs="*", default=None, metavar="T",
                        help="decode token counts (default 1 16 64; each is its own compile)")
    parser.add_argument("--train", type=int, nargs="*", default=None, metavar="T",
                        help="training token counts (default 2048 8192)")
    parser.add_argument("--merge-ab", action="store_true",
                        help="issue 27: also decode with opfuse.optimize(merge_projections=False)")
    parser.add_argument("--fp8", choices=["tensor", "row"], default=None,
                        help="issue 27: the training cases' opfuse variant in FP8, and a torchao float8 column")
    args = parser.parse_args()
    results, summary, started = {}, [], time.perf_counter()
    if args.from_json:
        saved = common.load_json(args.from_json)
        opts, results = saved["opts"], saved["results"]
    else:
        if not args.cpu and common.skip_without_gpus("model", min(args.world)):
            return 0
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        opts = dict(CPU if args.cpu else QUICK if args.quick else FULL, device="cpu" if args.cpu else "cuda")
        opts["fp8"], opts["merge_ab"] = args.fp8, args.merge_ab
        if args.no_train_8192:
            opts["train"] = [t for t in opts["train"] if t != 8192]
        if args.layers:
            opts["model"] = dict(opts["model"], layers=args.layers)
        for case in ("decode", "train"):
            counts = getattr(args, case)
            if counts is not None:
                bad = [t for t in counts if t < 1]
                if bad:
                    parser.error(f"--{case}: token counts must be >= 1, got {bad}")
                opts[case] = counts
        for world in args.world if args.cpu else common.worlds(args.world):
            results[str(world)] = common.run_ranks(worker, world, opts, backend="gloo" if args.cpu else "nccl",
                                                   timeout=3600)
    for world, result in results.items():
        text, rows = tables(world, result, opts)
        summary += rows
        print(text, flush=True)
    if args.cpu:
        print("\n(--cpu: a dry run of the code paths on gloo; the timings mean nothing)")
    print(f"\nsummary (targets of issue 14; ratios within one run; {time.perf_counter() - started:.0f} s in all)")
    print("| world | case | ratio | value | target | met |\n|---|---|---|---|---|---|")
    for world, case, what, value, target, met in summary:
        print(f"| {world} | {case} | {what} | {block.fmt(value, 2)} | {target} | "
              f"{'-' if met is None else ('yes' if met else 'NO')} |")
    common.finish(args, {"opts": opts, "results": results}, series=ratio_series(results), xlabel="tokens",
                  ylabel="time ratio (< 1: opfuse faster)", title="Llama-style decoder: opfuse backend / torch.compile")
    return 0


if __name__ == "__main__":
    sys.exit(main())
