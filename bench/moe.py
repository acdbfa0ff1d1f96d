"""Mixture of experts as Hugging Face writes it (examples/hf_moe.py: Mixtral's block, 8 experts,
top-2, in pre-norm residual layers), forward + backward on one GPU: opfuse.optimize (the per-expert
loop rewritten into two grouped GEMMs with device-side group sizes) against torch.compile of the
same model (Inductor; the loop's data-dependent shapes break the graph at every expert) and eager.

    PYTHONPATH=. python3 bench/moe.py                     # hidden 4096, ffn 14336, 2 layers, 4096 / 16384 tokens
    PYTHONPATH=. python3 bench/moe.py --fp8               # also opfuse with fp8=TensorScaling()
    PYTHONPATH=. python3 bench/moe.py --fp8 --fp8-pow2    # and TensorScaling(pow2_weight_scales=True)
    PYTHONPATH=. python3 bench/moe.py --quick             # hidden 1024, ffn 3584
    PYTHONPATH=. python3 bench/moe.py --fp8 --profile     # and a kernel table + idle-time split per variant
    PYTHONPATH=. python3 bench/moe.py --fp8 --fp8-wgrad-ab --only "opfuse fp8" "opfuse fp8 hp-wgrad"
    python3 bench/moe.py --cpu                             # the code paths on CPU (tiny; timings mean nothing)

Variants (same weights, same seed):
  eager            the model as written
  compile          torch.compile (Inductor), dynamic=False
  compile dynamic  torch.compile (Inductor), dynamic=None (automatic dynamic shapes: the per-expert
                   token counts change every step, so static shapes recompile until Dynamo's limit
                   and then run those frames eagerly); the target is taken against the faster of
                   the two compile variants
  rewrite+compile  opfuse.torch_compile.prepare_model, then torch.compile (Inductor): the rewrite alone
  opfuse           opfuse.optimize (rewrite + opfuse's backend)
  opfuse fp8       opfuse.optimize(fp8=TensorScaling()) (--fp8): the weight gradient in FP8 too
  opfuse fp8 hp-wgrad  the same with fp8_wgrad=False (--fp8-wgrad-ab): the bfloat16 wgrad
  opfuse fp8 pow2  TensorScaling(pow2_weight_scales=True) (--fp8-pow2): each expert's weight scale a power
                   of two, the stacked weights quantized in one read

Method: CUDA events around CALLS back-to-back steps (forward, backward of sum(out * g)), median of
REPS, after two warm-up steps (compilation). Each step first bumps every parameter's version counter
(``torch.autograd.graph.increment_version``, no data touched), as an optimizer step would: a variant
that caches derived weights (FP8 copies) pays for making them once per step, as in training. Target (issue 27): opfuse <= 0.8x compile.
"""

from __future__ import annotations

import copy
import logging
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import common  # noqa: E402  (bench/common.py)
import hf_moe  # noqa: E402  (examples/hf_moe.py)

TARGET = 0.8
FULL = dict(hidden=4096, ffn=14336, layers=2, experts=8, top_k=2, tokens=[4096, 16384], calls=3, reps=5)
QUICK = dict(FULL, hidden=1024, ffn=3584, tokens=[4096], reps=3)
CPU = dict(FULL, hidden=32, ffn=48, tokens=[64], calls=1, reps=1)


def _timed(fn, calls: int, reps: int, device: str) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(times)


class _RecompileLimitHits(logging.Handler):
    """Counts Dynamo's "hit config.recompile_limit" warnings while it is installed."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.hits = 0
        self.logger = logging.getLogger("torch._dynamo.convert_frame")
        self.logger.addHandler(self)

    def emit(self, record):
        if "recompile_limit" in record.getMessage():
            self.hits += 1

    def close(self):
        self.logger.removeHandler(self)
        super().close()


def measure(opts, fp8: bool, profile: bool = False, wgrad_ab: bool = False, pow2: bool = False):
    import opfuse

    device = opts["device"]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    base = hf_moe.MoEDecoder(hf_moe.MixtralSparseMoeBlock, layers=opts["layers"], hidden=opts["hidden"],
                             ffn=opts["ffn"], num_experts=opts["experts"], top_k=opts["top_k"]).to(device, dtype)
    inductor = device == "cuda"
    compile_kw = {} if inductor else {"backend": "aot_eager_decomp_partition"}
    options = {} if inductor else {"options": {"inductor": False}}

    def variants():
        yield "eager", copy.deepcopy(base), lambda m: m
        yield "compile", copy.deepcopy(base), lambda m: torch.compile(m, dynamic=False, **compile_kw)
        yield "compile dynamic", copy.deepcopy(base), lambda m: torch.compile(m, dynamic=None, **compile_kw)

        def rewritten(m):
            opfuse.torch_compile.prepare_model(m)
            return torch.compile(m, dynamic=False, **compile_kw)

        yield "rewrite+compile", copy.deepcopy(base), rewritten
        yield "opfuse", copy.deepcopy(base), lambda m: opfuse.optimize(m, **options)
        recipes = {"opfuse fp8 hp-wgrad": opfuse.fp8.TensorScaling(fp8_wgrad=False) if fp8 and wgrad_ab else None,
                   "opfuse fp8": opfuse.fp8.TensorScaling() if fp8 else None,
                   "opfuse fp8 pow2": opfuse.fp8.TensorScaling(pow2_weight_scales=True) if fp8 and pow2 else None}
        for name, recipe in recipes.items():
            if recipe is not None:
                yield name, copy.deepcopy(base), lambda m, recipe=recipe: opfuse.optimize(m, fp8=recipe, **options)

    rows, notes, profiles = [], [], {}
    for tokens in opts["tokens"]:
        x = torch.randn(1, tokens, opts["hidden"], device=device, dtype=dtype, generator=None)
        g = torch.randn_like(x)
        row = {"tokens": tokens}
        want = None
        for name, model, wrap in variants():
            if opts.get("only") and name != "eager" and name not in opts["only"]:
                continue
            fn = wrap(model)
            params = [p for p in model.parameters() if p.requires_grad]

            def step(fn=fn, params=params):
                for p in params:  # as after an optimizer step: FP8 copies of the weights are re-made each step
                    torch.autograd.graph.increment_version(p)
                xi = x.detach().requires_grad_()
                return torch.autograd.grad((fn(xi) * g).sum(), [xi] + params, allow_unused=True)

            limits = _RecompileLimitHits()
            try:
                out = step()
                if want is None:
                    want = out[0]
                row[f"{name} err"] = ((out[0].float() - want.float()).norm() / want.float().norm()).item()
                row[name] = _timed(step, opts["calls"], opts["reps"], device)
                if profile and device == "cuda":
                    import kernel_table  # noqa: PLC0415  (bench/kernel_table.py)
                    import step_timeline  # noqa: PLC0415  (bench/step_timeline.py)

                    found = profiles.setdefault(tokens, ({}, {}))
                    found[0][name] = kernel_table.profile_step(step, steps=2)
                    found[1][name] = step_timeline.step_timeline(step, steps=3)
                if name.startswith("opfuse"):
                    row[f"{name} fusions"] = sorted({f"{f.rule}={f.impl}" for p in opfuse.programs(fn)
                                                     for f in p.fusions})
            except Exception as error:  # noqa: BLE001 - one variant failing is a note, not an abort
                lines = str(error).splitlines() or [""]
                where = next((line.strip() for line in lines if line.strip().startswith("target:")), "")
                notes.append(f"T={tokens} {name}: {type(error).__name__}: {lines[0][:160]}"
                             + (f" ({where[:120]})" if where else ""))
                row[name] = None
            finally:
                limits.close()
            if limits.hits:
                notes.append(f"T={tokens} {name}: Dynamo hit its recompile limit {limits.hits}x (those frames then "
                             f"ran eagerly)")
            torch._dynamo.reset()
            common.progress(f"T={tokens} {name}: done")
        rows.append(row)
    return {"opts": opts, "rows": rows, "notes": notes, "profiles": profiles}


def main() -> int:
    parser = common.parser("moe", __doc__)
    parser.add_argument("--fp8", action="store_true", help="also opfuse with fp8=TensorScaling()")
    parser.add_argument("--fp8-pow2", action="store_true",
                        help="with --fp8, also opfuse with TensorScaling(pow2_weight_scales=True)")
    parser.add_argument("--fp8-wgrad-ab", action="store_true",
                        help="with --fp8, also opfuse with TensorScaling(fp8_wgrad=False) (bfloat16 weight gradient)")
    parser.add_argument("--quick", action="store_true", help="hidden 1024, ffn 3584, 4096 tokens")
    parser.add_argument("--cpu", action="store_true", help="the code paths on CPU (timings mean nothing)")
    parser.add_argument("--profile", action="store_true", help="a kernel table and an idle-time split per variant")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="token counts (default: 4096 16384)")
    parser.add_argument("--only", nargs="+", default=None, metavar="VARIANT",
                        help="time only these variants (eager is always run: the reference)")
    args = parser.parse_args()
    if args.from_json:
        data = common.load_json(args.from_json)
    else:
        if not args.cpu and common.skip_without_gpus("moe", 1):
            return 0
        opts = dict(CPU if args.cpu else QUICK if args.quick else FULL, device="cpu" if args.cpu else "cuda",
                    only=args.only)
        if args.tokens:
            opts["tokens"] = args.tokens
        if args.cpu:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        for flag in ("fp8_wgrad_ab", "fp8_pow2"):
            if getattr(args, flag) and not args.fp8:
                parser.error(f"--{flag.replace('_', '-')} needs --fp8")
        data = measure(opts, args.fp8, args.profile, args.fp8_wgrad_ab, args.fp8_pow2)
    opts = data["opts"]
    names = [n for n in ("eager", "compile", "compile dynamic", "rewrite+compile", "opfuse", "opfuse fp8 hp-wgrad",
                         "opfuse fp8", "opfuse fp8 pow2")
             if any(n in r for r in data["rows"])]
    rated = [n for n in ("opfuse", "opfuse fp8", "opfuse fp8 pow2") if n == "opfuse" or n in names]
    print(f"\nMixtral-style MoE, hidden {opts['hidden']}, ffn {opts['ffn']}, {opts['experts']} experts top-"
          f"{opts['top_k']}, {opts['layers']} layers, forward + backward, microseconds per step")
    print("| tokens | " + " | ".join(names) + " | " + " | ".join(f"{n} / best compile" for n in rated)
          + " | fusions |")
    print("|" + "---|" * (len(names) + len(rated) + 2))
    summary = []
    for r in data["rows"]:
        compiled = [r[n] for n in ("compile", "compile dynamic") if r.get(n)]
        speeds = [(r.get(n) / min(compiled)) if r.get(n) and compiled else None for n in rated]
        summary.append((r["tokens"], *speeds))
        cells = " | ".join("-" if r.get(n) is None else f"{r[n]:.0f}" for n in names)
        ratios = " | ".join("-" if v is None else f"{v:.2f}" for v in speeds)
        fusions = sorted(set().union(*(r.get(f"{n} fusions", []) for n in rated)))
        print(f"| {r['tokens']} | {cells} | {ratios} | {', '.join(fusions)} |")
    errors = "; ".join(f"T={r['tokens']}: " + ", ".join(f"{n} {r[n + ' err']:.1e}" for n in names if n + " err" in r)
                       for r in data["rows"])
    print(f"\nrelative error of the input gradient vs eager: {errors}")
    for note in data["notes"]:
        print(f"note: {note}")
    if data.get("profiles"):
        import kernel_table  # noqa: PLC0415
        import step_timeline  # noqa: PLC0415

        for tokens, (tables, timelines) in data["profiles"].items():
            print(kernel_table.format_tables(tables, f"T={tokens}"))
            print(step_timeline.format_timeline(timelines, f"T={tokens}"))
    print(f"\nsummary (target of issue 27: opfuse <= {TARGET}x compile; the faster of its static and dynamic variants)")
    for tokens, *speeds in summary:
        for name, speed in zip(rated, speeds):
            met = "-" if speed is None else ("yes" if speed <= TARGET else "NO")
            print(f"| T={tokens} | {name} / best compile | {'-' if speed is None else f'{speed:.2f}'} | <= {TARGET} "
                  f"| {met} |")
    if args.cpu:
        print("\n(--cpu: a dry run of the code paths; the timings mean nothing)")
    common.finish(args, data, bars={f"T={t}": s for t, s, *_ in summary if s is not None},
                  title="Mixtral-style MoE: opfuse / torch.compile", ylabel="time ratio (< 1: opfuse faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
