"""Whole model: the Llama-style decoder of examples/llama_tp.py at a realistic size, tensor-parallel,
compiled by opfuse's torch.compile backend, against torch.compile (Inductor; async TP where it
applies) and eager, in one run.

    PYTHONPATH=. python3 bench/model.py --world 2                   # the full world-2 table
    PYTHONPATH=. python3 bench/model.py --world 2 --cases train-tp --train 2048 --profile
    PYTHONPATH=. python3 bench/model.py --world 2 --quick           # hidden 1024: a smoke test
    python3 bench/model.py --world 2 --cpu                           # gloo + CPU dry run of the code paths

The model is the example's (F.scaled_dot_product_attention, rotary, SwiGLU MLP, hand-written
float32 RMSNorm), hidden 8192, 64 heads (8 kv), ffn 28672, 2 layers, bf16, vocabulary 4096 (the
decoder is what is measured), the same weights in every variant (same seed).

Cases:
  decode    gpt-fast's loop: static KV caches of 1024 positions (``Llama.setup_caches``; the loop starts
            at position 512), one new token per sequence
            per step at batch 1 / 8 / 64, the next token the argmax of the logits, the position a
            device tensor; ``--decode-steps`` steps back to back with no host sync between tokens,
            timed with CUDA events; tensor parallelism with torch.distributed all-reduces; both
            compiled variants with mode="reduce-overhead" (CUDA graphs). Floor: the weights one rank
            streams per token over the measured HBM copy rate.
  train-tp  forward + backward (gradients of every parameter, loss = sum(logits * g) for a fixed
            random g), torch.distributed all-reduces (Megatron TP without sequence parallelism)
  train-sp  the same with DTensor and sequence parallelism (torchtitan's plan; Inductor's async TP
            on for both compiled variants)
  Training runs at ``--train`` tokens per step (default 2048 8192) and ``--train-batch`` sequences
  (default 1 4; the sequence length is tokens / batch).

Variants: eager (training only), compile (torch.compile, Inductor), opfuse (opfuse.optimize);
``compile s`` / ``opfuse s``: the first call's wall time (compilation; Inductor's FX-graph and
autograd caches off for both; the two take turns compiling first, case by case, since the first
also pays for kernels the second finds compiled), ``opfuse passes s``: the part of it opfuse's own
passes took.
``--profile``: a kernel table per variant and case (bench/kernel_table.py: GPU time per kernel
category per step, the top kernels), so a regression is explained, not only seen; per training
variant also a steady-state timeline (bench/step_timeline.py) and where its host time goes
(bench/host_profile.py).

Method: CUDA events; training: medians of REPS batches of CALLS back-to-back steps after warm-up,
every batch after a barrier and one untimed step (the steady state of a training loop, not its
start from an idle GPU), the variants' order rotated every round; decode: median of REPS loops of
STEPS tokens; max over ranks. NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1.

The A/A control: every training case also times ``compile:again``, a second torch.compile model
(``--no-aa`` leaves it out). Two identical compiled models in one process differ by 3.6-7% on 2x
H100 (docs/PERF_NOTES.model.md, session 9), so an in-process ratio nearer 1 than the A/A ratio is
noise; bench/model_isolated.py times each variant alone in its own process (``--only``) instead.

FP8 and merged projections (issue 27): ``--fp8 tensor|tensor-pow2|row`` adds ``opfuse fp8`` (opfuse.optimize(fp8=
recipe), output head in bf16) and, where ``torchao`` imports, ``torchao fp8`` (torchao float8 +
torch.compile, tp cases) to the training cases (targets: <= 0.75x compile bf16, <= 0.92x torchao);
``--merge-ab`` adds ``opfuse unmerged`` (merge_projections=False) to decode (target: merged <= 0.97x).
``--pdl-ab`` adds ``opfuse no PDL`` (the peer kernels launched without programmatic dependent launch).
``--gqa-ab`` adds ``opfuse repeated kv`` (decode attention reading the key/value heads repeated, as the
model writes it: ``grouped_query_attention="repeat"``) and ``opfuse folded sdpa`` (the query groups
folded into the SDPA call at every batch: ``"fold"``) beside ``opfuse`` (``"auto"``: opfuse's Triton
``decode_attention`` on GPUs).

CUDA graphs in training: ``--train-mode reduce-overhead`` compiles every training variant with
mode="reduce-overhead" (cudagraph trees, ``torch.compiler.cudagraph_mark_step_begin()`` before each
step); ``BENCH_CUDAGRAPH_HISTORY=1`` records where a tensor left untracked in the graph pool came from.

Mixed precision: ``--autocast`` builds the training models in float32 and runs each step under
``torch.autocast(bfloat16)``: a float32 residual stream next to bfloat16 GEMM outputs, the add +
norm calls opfuse's kernels refuse (they take one dtype) and leave to Inductor
(opfuse/torch_compile/reference_fusions.py); the fusions column counts them ("left to Inductor").

Targets (issue 26): train-tp <= 0.92x compile; train-sp <= 0.90x compile with async TP; decode
<= 0.93x compile and <= 1.05x its weight-streaming floor; no case slower than compile; compile
time <= 1.0x compile's.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import block  # noqa: E402  (bench/block.py: timing helpers and Inductor's async-TP switch)
import block_report  # noqa: E402  (bench/block_report.py: number formats)
import common  # noqa: E402  (bench/common.py)
import fp8_variants  # noqa: E402  (bench/fp8_variants.py: --fp8, issue 27)
import gpu_clocks  # noqa: E402  (bench/gpu_clocks.py: SM clock and power while timed)
import llama_tp  # noqa: E402  (examples/llama_tp.py: the model)
import model_timing  # noqa: E402  (bench/model_timing.py: decode loop, round-robin timing)
from model_report import ratio_series, tables  # noqa: E402  (bench/model_report.py: the tables)

MODEL = dict(dim=8192, layers=2, heads=64, kv_heads=8, ffn=28672, vocab=4096, max_seq=8192)
FULL = dict(model=MODEL, cases=["decode", "train-tp", "train-sp"], decode=[1, 8, 64], train=[2048, 8192],
            train_batch=[1, 4], decode_steps=32, decode_start=512, decode_cache=1024, calls_train=3, reps=5,
            reps_train=5)
QUICK = dict(FULL, model=dict(MODEL, dim=1024, layers=2, heads=16, kv_heads=4, ffn=4096), decode=[1, 8],
             train=[512], train_batch=[1], decode_steps=16, reps=3, reps_train=3)
# --cpu: the code paths on gloo with CPU tensors; fused graphs run eagerly (no Inductor on two
# cores), torch.compile is aot_eager with Inductor's decompositions. Its timings mean nothing.
CPU = dict(FULL, model=dict(MODEL, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=96, max_seq=64),
           decode=[1, 2], train=[16], train_batch=[1, 2], decode_steps=2, decode_start=8, decode_cache=32,
           calls_train=2, reps=2, reps_train=2)
CASES = ("decode", "train-tp", "train-sp")
#: ``--shape``: the model's dimensions. ``small`` is Llama 3.2 1B's decoder (16 layers of hidden 2048):
#: many layers of small GEMMs, where a compiled model's host time per call, not its GPU time, can
#: decide a decode loop's speed.
SHAPES = {"bench": MODEL, "small": dict(MODEL, dim=2048, layers=16, heads=32, kv_heads=8, ffn=8192)}


def _compilers(device: str, decode: bool, fp8: str | None = None, train_mode: str = "default"):
    """``(torch.compile variant, opfuse variant)`` as functions of a model (``fp8``: the opfuse
    variant's recipe, ``--fp8``; bench/fp8_variants.py; ``train_mode``: ``--train-mode``, the
    training variants' torch.compile mode, the same for both)."""
    import opfuse

    fp8_kw = dict(fp8=fp8_variants.recipe(fp8), fp8_filter=fp8_variants.keep_high_precision) if fp8 else {}
    if device != "cuda":
        return (lambda m: torch.compile(m, backend="aot_eager_decomp_partition", dynamic=False),
                lambda m: opfuse.optimize(m, options={"inductor": False}, **fp8_kw))
    mode = "reduce-overhead" if decode else None if train_mode == "default" else train_mode
    return (lambda m: torch.compile(m, mode=mode, dynamic=False), lambda m: opfuse.optimize(m, mode=mode, **fp8_kw))


def _optimized_with(device: str, kwargs: dict):
    """The training opfuse variant compiled with ``opfuse.optimize(**kwargs)`` (``options``: Inductor's;
    none on CPU, where there is no Inductor)."""
    import opfuse

    kwargs = dict(kwargs)
    if device != "cuda":
        kwargs["options"] = {"inductor": False}
    return lambda m: opfuse.optimize(m, **kwargs)


def _unmerged(device: str):
    """--merge-ab (issue 27): the decode opfuse variant with ``merge_projections=False``."""
    import opfuse

    if device != "cuda":
        return lambda m: opfuse.optimize(m, merge_projections=False, options={"inductor": False})
    return lambda m: opfuse.optimize(m, merge_projections=False, mode="reduce-overhead")


def _with_settings(fn, **settings):
    """--pdl-ab, --gqa-ab: ``fn`` with every call (the first, which compiles; the CUDA-graph
    recording; the timed loop) under ``opfuse.config.override(**settings)``."""
    import opfuse

    def call(*args):
        with opfuse.config.override(**settings):
            return fn(*args)

    return call


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


def _first_call_order(names: list, case: int) -> list:
    """The order in which the variants of case number ``case`` compile: inside one process the first
    compile also pays for what later ones find cached (Triton kernels, Inductor's code), so
    torch.compile and opfuse take turns going first (even cases torch.compile, odd ones opfuse)."""
    names = list(names)
    if case % 2 and "compile" in names and "opfuse" in names:
        i, j = names.index("compile"), names.index("opfuse")
        names[i], names[j] = names[j], names[i]
    return names


def _fusions(compiled) -> tuple[str, float]:
    """What opfuse fused in ``compiled``'s graphs and the seconds its passes took."""
    import opfuse

    counts: dict[str, int] = {}
    seconds = 0.0
    for program in opfuse.programs(compiled):
        seconds += getattr(program, "seconds", 0.0)
        for record in program.fusions:
            key = f"{record.rule}({program.phases.get(record.fused_node, '?')[0]})={record.impl}"
            counts[key] = counts.get(key, 0) + 1
        for name, note in getattr(program, "overlap_decisions", ()):
            key = f"left to NCCL: {name}"
            counts[key] = counts.get(key, 0) + 1
        for source, note in program.notes:
            if source == "overlap" and "weight-only" in note:
                key = "weight work under a forward collective"
                counts[key] = counts.get(key, 0) + 1
            if source == "overlap" and "moved under this backward collective" in note:
                key = "weight gradient moved under a backward collective"
                counts[key] = counts.get(key, 0) + 1
            if source == "reference_fusions":  # "<node>: <fused op> left to Inductor: ..."
                key = f"left to Inductor: {note.split(': ')[1].split(' left')[0]}"
                counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n}x {k}" for k, n in sorted(counts.items())), seconds





#: Extra opfuse variants (``--variants``): the settings each compiles and runs under.
EXTRA_VARIANTS = {
    "opfuse:fuse-all": {"overlap_collectives": "fuse"},
    "opfuse:nccl-norm": {"force_impl": "allreduce_add_rmsnorm=nccl+cuda"},
    # Diagnosis (issue 26): sequence parallelism's batch > 1 gather fusion, off for CUDA tensors
    # under async TP since the pair gave wrong gradients at batch 4 (docs/PERF_NOTES.model.md), forced on; and
    # the same without Inductor's async TP (which the bench's sp graphs run with).
    "opfuse:sp-batch-on": {},
    "opfuse:sp-batch-on-no-async-tp": {},
    # Where a gap to torch.compile comes from (issue 26, "never slower"): the backend with no rule
    # applied (with and without the all-reduce overlap schedule and its Inductor settings), without
    # the standalone add + RMSNorm fusion, and without merged projections.
    "opfuse:no-fuse": {"fuse": False},
    "opfuse:no-fuse-no-overlap": {"fuse": False, "overlap_collectives": "fuse"},
    "opfuse:no-norm": {"disabled_rules": ("add_rmsnorm",)},
    "opfuse:no-merge": {},
    # FP8 (needs --fp8): each weight cast launched alone, as before the batched casts (issue 27).
    "opfuse fp8:unbatched": {"fp8_weight_batch_mb": 0},
    # FP8 (needs --fp8): the row-parallel GEMM + reduce-scatter as the FP8 GEMM then NCCL's
    # reduce-scatter, not the chunked GEMMs over peer memory (issue 27's train-sp 2048 step is
    # host-bound without CUDA graphs; session 28: the same host time either way).
    "opfuse fp8:nccl-rs": {"force_impl": "linear_reduce_scatter_fp8=nccl"},
    # FP8 (needs --fp8): the norms + quantize as opfuse's kernels behind custom ops, as before
    # session 29 made them aten ops for Inductor in graphs without CUDA graphs (opfuse.config.fp8_aten).
    "opfuse fp8:norm-kernels": {"fp8_aten": "never"},
    # FP8 (needs --fp8): also the collective FP8 GEMMs as aten ops (functional all-gather /
    # reduce-scatter around torch._scaled_mm), not the GEMM chunks over peer memory.
    "opfuse fp8:aten-collectives": {"fp8_aten": "always"},
    # A/A control: a second torch.compile model, timed like the others (the noise and any bias
    # of the timing between two identical variants).
    "compile:again": {},
}
#: The variants ``--only`` accepts (bench/model_isolated.py's ``--pair``).
ONLY_CHOICES = ("compile", "opfuse", "opfuse fp8", "torchao fp8")
#: ``opfuse.optimize`` arguments a variant compiles with (``options``: Inductor's config).
VARIANT_OPTIMIZE_KWARGS = {"opfuse:sp-batch-on-no-async-tp": {"options": {"_micro_pipeline_tp": False}},
                           "opfuse:no-merge": {"merge_projections": False}}
SP_BATCH_ON = ("opfuse:sp-batch-on", "opfuse:sp-batch-on-no-async-tp")


def opfuse_settings(**settings):
    import opfuse

    return opfuse.config.override(**settings) if settings else contextlib.nullcontext()



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
    if device == "cpu":
        from opfuse.torch_compile import fp8_aten

        # The dry run's FP8 graphs as a GPU's: the GEMMs written as aten ops (torch._scaled_mm) where
        # the GPU's scaled_mm implementation would be, instead of opaque reference ops, so the
        # passes that move GEMMs (overlap.py) see what they see on a GPU.
        fp8_aten.IMPLEMENTATIONS = {"reference"}
    rows, notes, profiles, timeline_rows, started = [], [], {}, {}, time.perf_counter()
    built = {}  # seconds the current case took to build its models (guarded's note)
    copy_gbs = None
    if device == "cuda" and "decode" in opts["cases"]:
        from timing import device_copy_gbs

        copy_gbs = -block._max_over_ranks([-device_copy_gbs()])[0]  # the slowest rank's

    def measured(row, key, thunk):
        try:
            row[key] = thunk()
        except Exception as error:  # noqa: BLE001 - the same failure on every rank: a note, not an abort
            notes.append(f"{row['case']} {row['shape']} {key}: {type(error).__name__}: "
                         f"{str(error).splitlines()[0][:160] if str(error) else ''}")
            row[key] = None
            block.sync()

    def profiled(row, fns):
        if not opts.get("profile"):
            return
        import host_profile
        import kernel_table
        import step_timeline

        found, timelines = {}, {}
        for name, fn in fns.items():
            try:
                if device == "cuda":  # on the CPU (--cpu) only the host profile means something
                    found[name] = kernel_table.profile_step(fn, steps=2)
                    timelines[name] = step_timeline.step_timeline(fn)
                lines = host_profile.host_profile(fn)
                if rank == 0:
                    print(f"host profile {row['case']} {row['shape']} {name} (own us/step, cumulative, calls):\n  "
                          + "\n  ".join(lines), flush=True)
            except Exception as error:  # noqa: BLE001 - the profile is diagnostics
                notes.append(f"profile {row['case']} {row['shape']} {name}: {type(error).__name__}: {error}")
        if rank == 0:
            profiles[f"{row['case']} {row['shape']}"] = found
            timeline_rows[f"{row['case']} {row['shape']}"] = timelines

    def guarded(label, case, *args):
        """One case; a failure becomes a note (the same failure on every rank) and the run goes on.
        Its wall time and the part that built its models go to the notes (the table's own cost)."""
        start = time.perf_counter()
        try:
            case(*args)
            if rank == 0:
                notes.append(f"{label}: {time.perf_counter() - start:.0f} s in all, models built in "
                             f"{built.pop('s', 0.0):.0f} s")
        except Exception as error:  # noqa: BLE001 - a case that cannot run is reported, not fatal
            notes.append(f"{label}: {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}")
            torch._dynamo.reset()
            if device == "cuda":
                torch.cuda.empty_cache()
            if rank == 0:
                common.progress(f"world {world} {label}: failed ({type(error).__name__})")
                traceback.print_exc()  # the whole message (a cudagraph pool check lists the allocations)

    def finish(row):
        keys = [k for k in row if k not in ("case", "shape", "fusions", "err")]  # the same on every rank
        lowest = [None if v is None else -v for v in block._max_over_ranks(
            [None if row[k] is None else -row[k] for k in keys])]
        for key, value in zip(keys, block._max_over_ranks([row[k] for k in keys])):
            row[key] = value
        # The table reports the slowest rank; where the ranks differ by more than 1%, say so (a rank
        # waiting on a slower peer shows here, and a one-rank profile would not show it).
        spread = {k: (lo, row[k]) for k, lo in zip(keys, lowest)
                  if lo and row[k] and not k.endswith(" s") and row[k] > 1.01 * lo}
        if spread and world > 1:
            notes.append(f"{row['case']} {row['shape']}: ranks differ (us, fastest rank / slowest): " + ", ".join(
                f"{k} {lo:.1f} / {hi:.1f}" for k, (lo, hi) in spread.items()))
        row["err"] = dict(zip(row["err"], block._max_over_ranks(list(row["err"].values()))))
        rows.append(row)
        torch._dynamo.reset()
        if device == "cuda":
            torch.cuda.empty_cache()
        if rank == 0:  # the numbers as they come: a run cut off by its time limit keeps what it measured
            times = ", ".join(f"{k} {row[k]:.1f}" for k in row if k not in ("case", "shape", "fusions", "err")
                              and isinstance(row[k], float))
            common.progress(f"world {world} {row['case']} {row['shape']}: {times}; {row.get('fusions', '')}")
            with open(out_path, "w") as handle:
                json.dump({"rows": rows, "notes": notes, "profiles": profiles, "timelines": timeline_rows,
                           "copy_gbs": copy_gbs,
                           "seconds": time.perf_counter() - started}, handle)

    if "decode" in opts["cases"]:
        compile_fn, opfuse_fn = _compilers(device, decode=True)
        steps, start = opts["decode_steps"], opts["decode_start"]
        def decode_case(batch):
            names = ("eager", "compile", "opfuse") + (("opfuse unmerged",) if opts.get("merge_ab") else ()) \
                + (("opfuse no PDL",) if opts.get("pdl_ab") else ()) \
                + (("opfuse repeated kv", "opfuse folded sdpa") if opts.get("gqa_ab") else ())
            building = time.perf_counter()
            full = llama_tp.unsharded(cfg, dtype, device)
            models = {v: llama_tp.build("dist", rank, world, cfg, dtype, device, full=full) for v in names}
            full = None
            built['s'] = time.perf_counter() - building
            gen, filled = torch.Generator(device=device).manual_seed(6), []
            for model in models.values():
                model.setup_caches(batch, opts["decode_cache"])
                caches = [buf for layer in model.layers for buf in (layer.attention.kv_cache.k,
                                                                     layer.attention.kv_cache.v)]
                if not filled:  # a filled cache, the same in every variant
                    filled = [torch.randn(buf.shape, generator=gen, device=device).to(buf) for buf in caches]
                for buf, values in zip(caches, filled):
                    buf.copy_(values)
            filled = None
            row = {"case": "decode", "shape": f"batch {batch}"}
            with torch.no_grad():
                ids = torch.randint(0, cfg.vocab, (batch, 1), generator=torch.Generator().manual_seed(3)).to(device)
                pos = torch.tensor([start], device=device)
                want = models["eager"](ids, pos)
                compiled = {"compile": compile_fn(models["compile"]), "opfuse": opfuse_fn(models["opfuse"])}
                if opts.get("merge_ab"):  # issue 27: the same without merged projections
                    compiled["opfuse unmerged"] = _unmerged(device)(models["opfuse unmerged"])
                if opts.get("pdl_ab"):  # issue 30: the peer kernels launched without PDL (captured so)
                    compiled["opfuse no PDL"] = _with_settings(opfuse_fn(models["opfuse no PDL"]), pdl=False)
                if opts.get("gqa_ab"):  # the attention reading repeated key/value heads, as the model writes it
                    for name, setting in (("opfuse repeated kv", "repeat"), ("opfuse folded sdpa", "fold")):
                        compiled[name] = _with_settings(opfuse_fn(models[name]), grouped_query_attention=setting)
                errors = {}
                for name in _first_call_order(list(compiled), len(rows)):
                    fn = compiled[name]
                    out, row[f"{name} s"] = _first_call(lambda fn=fn: fn(ids, pos))
                    errors[name] = block.rel(out.float(), want.float())
                    for _ in range(2):  # reduce-overhead: warm-up, then recording of the CUDA graph
                        fn(ids, pos)
                loops = {name: model_timing.decode_loop(fn, batch, start, steps, device)
                         for name, fn in compiled.items()}
                for name, loop in loops.items():
                    measured(row, name, lambda loop=loop: model_timing.loop_us(loop, steps, opts["reps"], device))
                if opts.get("decode_sync"):  # the same compiled models, the host reading each token
                    for name, fn in compiled.items():
                        loop = model_timing.decode_loop(fn, batch, start, steps, device, sync=True)
                        measured(row, f"{name} host-read",
                                 lambda loop=loop: model_timing.loop_us(loop, steps, opts["reps"], device))
                if copy_gbs:
                    row["floor"] = model_timing.weight_bytes(models["opfuse"]) / copy_gbs / 1e3
                profiled(row, loops)
            row["fusions"], row["opfuse passes s"] = _fusions(compiled["opfuse"])
            row["err"] = errors
            models = compiled = loops = None  # free before the next size
            finish(row)

        for batch in opts["decode"]:
            guarded(f"decode batch {batch}", decode_case, batch)

    train_mode = opts.get("train_mode", "default")
    compile_fn, opfuse_fn = _compilers(device, decode=False, train_mode=train_mode)
    fp8_fn = _compilers(device, decode=False, fp8=opts.get("fp8"), train_mode=train_mode)[1] \
        if opts.get("fp8") else None
    graphed = train_mode == "reduce-overhead" and device == "cuda"
    if graphed and os.environ.get("BENCH_CUDAGRAPH_HISTORY") == "1":  # where an untracked pool tensor came from
        from torch._inductor import config as inductor_config

        inductor_config.triton.cudagraph_trees_history_recording = True
    if graphed:
        notes.append("--train-mode reduce-overhead: compile, opfuse and opfuse fp8 train with CUDA graphs "
                     "(cudagraph trees; torch.compiler.cudagraph_mark_step_begin() before each step)")
    torchao_fn, torchao_note = fp8_variants.torchao_compiler(opts.get("fp8"), None if train_mode == "default"
                                                              else train_mode)
    if opts.get("fp8"):
        notes.append(f"--fp8 {opts['fp8']}: 'opfuse fp8' runs opfuse.optimize(fp8=...) (output head in bf16); "
                     f"torchao column: {torchao_note}")
    async_tp = None

    train_dtype = torch.float32 if opts.get("autocast") else dtype
    if opts.get("autocast"):
        notes.append("--autocast: training models in float32, each step under torch.autocast(bfloat16)")

    def mixed_precision():
        if not opts.get("autocast"):
            return contextlib.nullcontext()
        return torch.autocast(device, dtype=torch.bfloat16)

    def train_case(mode, tp, tokens, batch):
        seq = tokens // batch
        extra = list(opts.get("variants", ()))
        if opts.get("fp8"):  # issue 27: FP8 opfuse, and torchao float8 where it imports (tp cases)
            extra.append("opfuse fp8")
            if torchao_fn is not None and mode == "tp":
                extra.append("torchao fp8")
        only = opts.get("only")
        if only:  # --only: one compiled model in this process (eager stays as the reference)
            if only not in ("compile", "opfuse") and only not in extra:
                notes.append(f"train-{mode} {tokens} tok, batch {batch}: --only {only!r} does not run here "
                             f"({'needs --fp8' if not opts.get('fp8') else 'torchao: train-tp only, where it imports'})"
                             f"; skipped")
                return
            extra = [only] if only not in ("compile", "opfuse") else []
        elif opts.get("aa", True) and "compile:again" not in extra:
            extra.insert(0, "compile:again")  # the A/A control: what two identical models differ by here
        names = ["eager", only] if only else ["eager", "compile", "opfuse", *extra]
        building = time.perf_counter()
        full = llama_tp.unsharded(cfg, train_dtype, device)
        models = {v: llama_tp.build(tp, rank, world, cfg, train_dtype, device, full=full) for v in names}
        full = None
        built['s'] = time.perf_counter() - building
        ids = torch.randint(0, cfg.vocab, (batch, seq), generator=torch.Generator().manual_seed(4)).to(device)
        grad = torch.randn(batch, seq, cfg.vocab, generator=torch.Generator().manual_seed(5)).to(device, train_dtype)
        row = {"case": f"train-{mode}", "shape": f"{tokens} tok, batch {batch}"}
        builders = {"compile": compile_fn, "opfuse": opfuse_fn, "compile:again": compile_fn, "opfuse fp8": fp8_fn,
                    "torchao fp8": torchao_fn}
        builders.update({name: (_optimized_with(device, VARIANT_OPTIMIZE_KWARGS[name])
                                if name in VARIANT_OPTIMIZE_KWARGS else fp8_fn if name.startswith("opfuse fp8")
                                else opfuse_fn)
                         for name in EXTRA_VARIANTS if name != "compile:again"})
        steps_ = {"eager": models["eager"]}
        steps_.update({name: builders[name](models[name]) for name in names[1:] if builders.get(name) is not None})

        def step(name):
            from opfuse.core.passes import sequence_batch

            params = [p for p in models[name].parameters() if p.requires_grad]
            settings = EXTRA_VARIANTS.get(name, {})

            def run():
                if graphed and name != "eager":  # a new step: the previous step's graph outputs may be reused
                    torch.compiler.cudagraph_mark_step_begin()
                with opfuse_settings(**settings), sequence_batch.refusal_lifted(name in SP_BATCH_ON), \
                        mixed_precision():
                    out = steps_[name](ids)
                return torch.autograd.grad(out, params, grad.to(out.dtype))

            return run

        want = step("eager")()
        errors = {}
        for name in _first_call_order(names[1:], len(rows)):
            try:
                got, row[f"{name} s"] = _first_call(step(name))
            except Exception as error:  # noqa: BLE001 - an extra variant that cannot run leaves the others
                if name not in extra:
                    raise
                extra.remove(name)
                names.remove(name)
                notes.append(f"{row['case']} {row['shape']} {name}: failed, left out: {type(error).__name__}: "
                             f"{' '.join(str(error).split())[:400]}")
                if rank == 0:
                    traceback.print_exc()
                continue
            errors[name] = max(block.rel(a.float(), b.float()) for a, b in zip(_local(got), _local(want)))
        calls, reps = opts["calls_train"], opts["reps_train"]
        host = {}
        clocks = gpu_clocks.Sampler.for_current_device() if device == "cuda" else None
        if clocks is not None:
            clocks.start()
        try:
            measured(row, "interleaved", lambda: row.update(
                model_timing.interleaved_us({n: step(n) for n in names if not (only and n == "eager")}, calls,
                                            reps, device, host, clocks)))
        finally:
            if clocks is not None:
                clocks.stop()
        row.pop("interleaved", None)
        if host and rank == 0:  # rank 0's: a host slower than the GPU idles it (issue 26: look here first)
            notes.append(f"{row['case']} {row['shape']}: host time to issue one step (us, rank 0): " + ", ".join(
                f"{name} {us:.0f}" for name, us in host.items()))
        if clocks is not None and rank == 0:  # the timed steps run at the power limit (session 28): at what clock
            seen = gpu_clocks.summary(clocks.samples, clocks.spans)
            notes.append(f"{row['case']} {row['shape']}: SM clock and board power while timed (rank 0's GPU, median "
                         f"of NVML samples every 10 ms): " + ", ".join(
                             f"{name} {mhz:.0f} MHz {watts:.0f} W ({n})" for name, (mhz, watts, n) in seen.items()))
        profiled(row, {name: step(name) for name in names[1:]})
        if "opfuse" in steps_:
            row["fusions"], row["opfuse passes s"] = _fusions(steps_["opfuse"])
        if "opfuse fp8" in steps_ and rank == 0:
            notes.append(f"{row['case']} {row['shape']}: opfuse fp8 fused {_fusions(steps_['opfuse fp8'])[0]}")
        row["err"] = errors
        models = steps_ = want = None  # free before the next size
        finish(row)

    for mode in ("tp", "sp"):
        if f"train-{mode}" not in opts["cases"]:
            continue
        if mode == "sp" and device == "cuda" and not graphed:
            async_tp = block.AsyncTP()  # Inductor's micro-pipeline TP for the torch.compile baseline (and opfuse's)
        elif mode == "sp" and graphed:
            notes.append("train-sp under --train-mode reduce-overhead: Inductor's async TP off (torch allocates its "
                         "symmetric-memory workspace in the cudagraph pool, which fails the pool check)")
        tp = "dist" if mode == "tp" else "dtensor-sp"
        for tokens in opts["train"]:
            for batch in opts["train_batch"]:
                if tokens % batch or (mode == "sp" and (tokens // batch) % world):
                    notes.append(f"train-{mode}: {tokens} tokens do not split into {batch} sequences "
                                 f"(sharded {world} ways); skipped")
                    continue
                guarded(f"train-{mode} {tokens} tok, batch {batch}", train_case, mode, tp, tokens, batch)
    if async_tp is not None:
        notes.append(f"async TP (Inductor micro-pipeline TP, sp graphs): matched {async_tp.candidates}, fused "
                     f"{async_tp.fused}")
    if opts.get("profile"):
        try:  # where compilation went (dynamo, AOTAutograd, Inductor), summed over every compile of the run
            notes.append("compile phases (s, summed over the run's compiles): " + ", ".join(
                f"{name} {sum(values):.1f}" for name, values in torch._dynamo.utils.compilation_time_metrics.items()
                if sum(values) >= 1.0))
        except Exception:  # noqa: BLE001 - diagnostics
            pass
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump({"rows": rows, "notes": notes, "profiles": profiles, "timelines": timeline_rows,
                           "copy_gbs": copy_gbs,
                       "seconds": time.perf_counter() - started}, handle)


def _local(tensors):
    return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]


def main() -> int:
    parser = common.parser("model", __doc__)
    parser.add_argument("--world", type=int, nargs="+", default=[2])
    parser.add_argument("--quick", action="store_true", help="hidden 1024, 2 layers: a smoke test")
    parser.add_argument("--cpu", action="store_true", help="gloo + CPU dry run of the code paths (no timings)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=None, help="default: all")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: 2)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="model dimensions: bench (default: hidden 8192, 2 layers) or small (Llama 3.2 1B's "
                             "decoder: hidden 2048, 16 layers, 32 heads (8 kv), ffn 8192)")
    parser.add_argument("--decode-sync", action="store_true",
                        help="decode: also time each variant with the host reading each next token before the next "
                             "step ('<variant> host-read'), as Hugging Face's generate does for its stopping check: "
                             "the host's time per token then adds to the GPU's")
    parser.add_argument("--decode", type=int, nargs="*", default=None, metavar="B",
                        help="decode batch sizes (default 1 8 64; each is its own compile)")
    parser.add_argument("--decode-steps", type=int, default=None, help="tokens per timed decode loop (default 32)")
    parser.add_argument("--train", type=int, nargs="*", default=None, metavar="T",
                        help="training tokens per step (default 2048 8192)")
    parser.add_argument("--train-batch", type=int, nargs="*", default=None, metavar="B",
                        help="sequences per training step (default 1 4)")
    parser.add_argument("--profile", action="store_true", help="a kernel table per variant and case")
    parser.add_argument("--merge-ab", action="store_true",
                        help="issue 27: also decode with opfuse.optimize(merge_projections=False)")
    parser.add_argument("--pdl-ab", action="store_true",
                        help="issue 30: also decode with opfuse's peer kernels launched without PDL")
    parser.add_argument("--gqa-ab", action="store_true",
                        help="issue 26: also decode with the attention reading repeated key/value heads")
    parser.add_argument("--fp8", choices=fp8_variants.RECIPE_NAMES, default=None,
                        help="issue 27: training cases also run opfuse in FP8, and torchao float8 where it imports")
    parser.add_argument("--only", choices=list(ONLY_CHOICES), default=None,
                        help="training cases: compile and time this variant alone in the process (no other "
                             "compiled model beside it; run once per variant and compare across runs; the fp8 "
                             "ones need --fp8)")
    parser.add_argument("--autocast", action="store_true",
                        help="training cases: a float32 model under torch.autocast(bfloat16), as mixed-precision "
                             "training runs (float32 residual stream, bfloat16 GEMMs)")
    parser.add_argument("--train-mode", choices=["default", "reduce-overhead"], default="default",
                        help="training cases: torch.compile mode of every compiled variant (reduce-overhead: CUDA "
                             "graphs, for a step whose host issue time is at its GPU time; default: none)")
    parser.add_argument("--no-aa", action="store_true",
                        help="training cases: leave out the A/A control (a second torch.compile model)")
    parser.add_argument("--variants", nargs="*", choices=sorted(EXTRA_VARIANTS), default=[],
                        help="extra opfuse variants in the training cases (settings in EXTRA_VARIANTS)")
    args = parser.parse_args()
    if not args.fp8 and any(v.startswith("opfuse fp8") for v in args.variants):
        parser.error(f"--variants {' '.join(v for v in args.variants if v.startswith('opfuse fp8'))}: needs --fp8")
    results, summary, started = {}, [], time.perf_counter()
    if args.from_json:
        saved = common.load_json(args.from_json)
        opts, results = saved["opts"], saved["results"]
    else:
        if not args.cpu and common.skip_without_gpus("model", min(args.world)):
            return 0
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        opts = dict(CPU if args.cpu else QUICK if args.quick else FULL, device="cpu" if args.cpu else "cuda",
                    profile=args.profile, variants=args.variants, only=args.only, aa=not args.no_aa, fp8=args.fp8,
                    merge_ab=args.merge_ab, pdl_ab=args.pdl_ab, gqa_ab=args.gqa_ab, autocast=args.autocast, train_mode=args.train_mode,
                    decode_sync=args.decode_sync)
        if args.cases:
            opts["cases"] = args.cases
        if args.shape:
            opts["model"] = dict(SHAPES[args.shape], vocab=opts["model"]["vocab"], max_seq=opts["model"]["max_seq"])
        if args.layers:
            opts["model"] = dict(opts["model"], layers=args.layers)
        if args.decode_steps:
            opts["decode_steps"] = args.decode_steps
        for key in ("decode", "train", "train_batch"):
            counts = getattr(args, key)
            if counts is not None:
                bad = [t for t in counts if t < 1]
                if bad:
                    parser.error(f"--{key.replace('_', '-')}: values must be >= 1, got {bad}")
                opts[key] = counts
        for world in args.world if args.cpu else common.worlds(args.world):
            results[str(world)] = common.run_ranks(worker, world, opts, backend="gloo" if args.cpu else "nccl",
                                                   timeout=3600)
    for world, result in results.items():
        text, rows = tables(world, result, opts)
        summary += rows
        print(text, flush=True)
    if args.cpu:
        print("\n(--cpu: a dry run of the code paths on gloo; the timings mean nothing)")
    print(f"\nsummary (targets of issue 26; ratios within one run; {time.perf_counter() - started:.0f} s in all)")
    print("| world | case | ratio | value | target | met |\n|---|---|---|---|---|---|")
    for world, case, what, value, target, met in summary:
        print(f"| {world} | {case} | {what} | {block_report.fmt(value, 2)} | {target} | "
              f"{'-' if met is None else ('yes' if met else 'NO')} |")
    common.finish(args, {"opts": opts, "results": results}, series=ratio_series(results), xlabel="case",
                  ylabel="time ratio (< 1: opfuse faster)", title="Llama-style decoder: opfuse backend / torch.compile")
    return 0


if __name__ == "__main__":
    sys.exit(main())
