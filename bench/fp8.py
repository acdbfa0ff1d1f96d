"""FP8 against bfloat16 in one run: the MLP block (training forward+backward and decode), the grouped
GEMM of a mixture-of-experts layer, and a short training run.

    PYTHONPATH=. python3 bench/fp8.py --world 1 2          # hidden 8192, ffn 28672; 32 experts
    PYTHONPATH=. python3 bench/fp8.py --world 2 --quick    # small sizes, a smoke test
    PYTHONPATH=. python3 bench/fp8.py --only grouped       # block | grouped | training
    (+ the common flags: --json FILE, --plot FILE, --from-json FILE; bench/common.py)

Without a CUDA GPU it prints one line and exits 0 (the training comparison runs on CPU in
emulation as tests/unit/test_fp8.py); a GPU without FP8 tensor cores (before sm89) likewise.

Block: RMSNorm -> Linear -> GELU(tanh) -> Linear (+ bias) -> + residual -> RMSNorm (as bench/block.py),
bf16 parameters, as ``ops.Sequential``; world 1 unsharded, world 2 tensor parallel (decode) and
sequence parallel (training). Variants: ``bf16`` (no autocast), ``tensor`` and ``row`` (under
``fp8.autocast`` with ``TensorScaling()`` / ``RowwiseScaling()``). Cases:
  train   8192 tokens, forward + backward (``torch.autograd.grad`` of inputs and parameters with fixed
          output gradients); the FP8 weight cache is cleared before every step, so each step pays
          the weight quantization a training step pays after its optimizer update
  decode  1, 16, 64 tokens, forward under ``torch.no_grad``, ``fp8.autocast(frozen_weights=True)``
          (inference: FP8 weights quantized once, also read by the captured graphs): eager, and a
          CUDA graph of CALLS calls
  decode+next  (world > 1) decode of the block followed by the next layer's column-parallel GEMM:
          the closing all-reduce + add + RMSNorm then emits FP8 (allreduce_add_rmsnorm_quantize)
Grouped: GroupedLinear of 32 experts, K=7168, N=2048 (bench/grouped.py's shape), random routing,
32768 and 256 routed tokens; bf16 (the implementation opfuse picks) against FP8 (x quantized in
the call), forward (weights cached: inference) and forward+backward (weights quantized in every
step, as in training); and the GEMMs alone
(``torch._grouped_mm`` on bf16 against ``torch._scaled_grouped_mm`` on quantized operands).
Training run: bench/fp8_training.py (hidden 1024, ffn 4096, 1024 tokens, 300 Adam steps), bf16 vs
both recipes, the mean of the last 10 losses.

Timing: CUDA events around CALLS back-to-back calls, median of REPS, max over ranks; graphs as
bench/timing.py. NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1.

Targets (issue 17): FP8 block forward+backward >= 1.4x faster than bf16 at 8192 tokens (world 2);
FP8 grouped GEMM >= 1.5x bf16 at 32768 tokens; the training run's final loss within 2% of bf16's.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import opfuse  # noqa: E402
from opfuse import fp8, ops  # noqa: E402
from opfuse.families.quantize import weight_cache  # noqa: E402
import common  # noqa: E402  (bench/common.py)
from timing import graph_replay_us, max_over_ranks, median  # noqa: E402  (bench/timing.py)

VARIANTS = {"bf16": None, "tensor": fp8.TensorScaling(), "row": fp8.RowwiseScaling()}
TARGETS = {"block": 1.4, "grouped": 1.5, "loss": 0.02}
FULL = dict(hidden=8192, ffn=28672, train=[8192], decode=[1, 16, 64], calls_t=3, reps_t=5, calls_d=20, reps_d=7,
            experts=32, k=7168, n=2048, routed=[32768, 256], steps=300, run_hidden=1024, run_ffn=4096, run_tokens=1024)
QUICK = dict(hidden=1024, ffn=4096, train=[2048], decode=[1, 16], calls_t=3, reps_t=3, calls_d=10, reps_d=3,
             experts=8, k=1024, n=512, routed=[4096, 64], steps=60, run_hidden=256, run_ffn=1024, run_tokens=256)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def eager_us(fn, calls, reps, before=None):
    """Median microseconds per call over ``reps`` batches of ``calls`` calls (``before`` runs,
    untimed on the host but inside the batch, before each call)."""
    for _ in range(2):
        if before:
            before()
        fn()
    times = []
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            if before:
                before()
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return median(times)


def graph_us(fn, calls, reps):
    return median(graph_replay_us(fn, calls, reps))


# Block ---------------------------------------------------------------------------------------------------------


def make_block(hidden, ffn, world, sp, next_gemm=False):
    """The MLP block; ``next_gemm``: followed by the next layer's column-parallel GEMM, so that the
    closing all-reduce + add + RMSNorm feeds an FP8 GEMM (allreduce_add_rmsnorm_quantize)."""
    kw = dict(dtype=torch.bfloat16, device="cuda")
    parallel = dict(parallel="column", sequence_parallel=sp) if world > 1 else {}
    row = dict(parallel="row", sequence_parallel=sp) if world > 1 else {}
    tail = [ops.Linear(hidden, ffn, **parallel, **kw)] if next_gemm else []
    block = ops.Sequential(ops.RMSNorm(hidden, **kw), ops.Linear(hidden, ffn, **parallel, **kw), ops.GELU("tanh"),
                           ops.Linear(ffn, hidden, **row, **kw), ops.AddExtraInput(), ops.MakeExtraOutput(),
                           ops.RMSNorm(hidden, **kw), *tail)
    torch.manual_seed(1234)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5 if p.dim() == 2 else 1 + 0.1 * torch.randn_like(p))
    return block


def block_rows(rank, world, o):
    rows = []
    cases = [("train", t) for t in o["train"]] + [("decode", t) for t in o["decode"]]
    if world > 1:  # the layer boundary: all-reduce + add + RMSNorm emitting FP8 for the next GEMM
        cases += [("decode+next", t) for t in o["decode"]]
    for case, tokens in cases:
        sp = world > 1 and case == "train"
        block = make_block(o["hidden"], o["ffn"], world, sp, next_gemm=case == "decode+next")
        local = tokens // world if sp else tokens
        gen = torch.Generator(device="cuda").manual_seed(7 + (rank if sp else 0))
        x, r, gy, gh = (torch.randn(local, o["hidden"], generator=gen, device="cuda").to(torch.bfloat16)
                        for _ in range(4))
        row = {"case": case, "tokens": tokens, "us": {}, "err": {}, "impls": {}}
        outputs = {}
        for name, recipe in VARIANTS.items():
            # Decode is inference: frozen weights (graphs read the FP8 weights quantized before capture).
            with fp8.autocast(enabled=recipe is not None, recipe=recipe, frozen_weights=case != "train"):
                if case == "train":
                    xl, rl = x.clone().requires_grad_(), r.clone().requires_grad_()
                    leaves = [xl, rl] + list(block.parameters())

                    def step():
                        return torch.autograd.grad(block(xl, rl), leaves, (gy, gh))

                    outputs[name] = step()
                    row["us"][name] = eager_us(step, o["calls_t"], o["reps_t"], before=weight_cache.clear)
                    program = opfuse.compile(block, xl, rl)
                else:
                    with torch.no_grad():
                        outputs[name] = block(x, r)
                        row["us"][name] = eager_us(lambda: block(x, r), o["calls_d"], o["reps_d"])
                        row["us"][name + ":graph"] = graph_us(lambda: block(x, r), o["calls_d"], o["reps_d"])
                        program = opfuse.compile(block, x, r)
            if recipe is not None:
                row["impls"][name] = ", ".join(f"{f.rule}={f.impl}" for f in program.fusions)
        for name in ("tensor", "row"):
            row["err"][name] = max(rel(a, b) for a, b in zip(outputs[name], outputs["bf16"]))
        keys = list(row["us"])
        row["us"] = dict(zip(keys, [max_over_ranks(row["us"][k]) for k in keys]))
        rows.append(row)
        del block, outputs
        torch.cuda.empty_cache()
        if rank == 0:
            common.progress(f"block world {world} {case} T={tokens} done")
    return rows


def block_worker(rank, world, o, out_path):
    import json

    rows = block_rows(rank, world, o)
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(rows, handle)


# Grouped -----------------------------------------------------------------------------------------------------


def routing(tokens, experts, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.bincount(torch.randint(0, experts, (tokens,), generator=gen), minlength=experts)


def grouped_rows(o):
    from opfuse.fp8 import grouped as fp8_grouped
    from opfuse.families.grouped_linear.fp8 import scaled_grouped_mm

    rows = []
    e, k, n = o["experts"], o["k"], o["n"]
    for tokens in o["routed"]:
        layer = ops.GroupedLinear(e, k, n, device="cuda", dtype=torch.bfloat16)
        block = ops.Sequential(layer)
        sizes = routing(tokens, e).to(device="cuda", dtype=torch.int32)
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        row = {"tokens": tokens, "us": {}, "err": {}, "impls": {}}
        outputs = {}
        for name, recipe in VARIANTS.items():
            with fp8.autocast(enabled=recipe is not None, recipe=recipe):
                with torch.no_grad():
                    outputs[name] = block(x, sizes)
                    row["us"][name] = eager_us(lambda: block(x, sizes), 10, 5)
                xl = x.clone().requires_grad_()
                row["us"][name + ":fwd+bwd"] = eager_us(
                    lambda: torch.autograd.grad(block(xl, sizes), [xl, layer.weight], dy), 5, 5,
                    before=weight_cache.clear)
                row["impls"][name] = opfuse.compile(block, x, sizes).fusions[0].impl
        for name in ("tensor", "row"):
            row["err"][name] = rel(outputs[name], outputs["bf16"])
        offs = scaled_grouped_mm.offsets(sizes, tokens)
        w = layer.weight
        if hasattr(torch, "_grouped_mm"):
            row["us"]["gemm:bf16"] = eager_us(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), 10, 5)
        recipe = fp8.RowwiseScaling()
        xq = fp8_grouped.input_operand(x, sizes, recipe)
        wq = scaled_grouped_mm._weight(w, "", e, recipe)
        row["us"]["gemm:fp8"] = eager_us(lambda: torch._scaled_grouped_mm(
            xq.data, wq.data.transpose(-2, -1), xq.scale_inv, wq.scale_inv, offs=offs, out_dtype=torch.bfloat16), 10, 5)
        rows.append(row)
        common.progress(f"grouped T={tokens} done")
    return rows


def training_rows(o):
    from fp8_training import smoothed, train

    rows = []
    for name, recipe in VARIANTS.items():
        t0 = time.perf_counter()
        losses = train(recipe, steps=o["steps"], hidden=o["run_hidden"], ffn=o["run_ffn"], tokens=o["run_tokens"])
        rows.append({"variant": name, "first": losses[0], "final": smoothed(losses),
                     "seconds": time.perf_counter() - t0})
    common.progress("training run done")
    return rows


# Tables -------------------------------------------------------------------------------------------------------


def fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def speedup(base, other):
    return None if base is None or other is None or other <= 0 else base / other


def print_block(world, rows, summary):
    print(f"\nMLP block, world {world}: microseconds per call (ratio = bf16 / FP8: > 1 is faster)")
    print("| case | tokens | bf16 | FP8 tensor | FP8 row | tensor speedup | row speedup | err tensor | err row |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for suffix in ("", ":graph"):
            us = r["us"]
            if "bf16" + suffix not in us:
                continue
            case = r["case"] + (" (graph)" if suffix else " fwd+bwd" if r["case"] == "train" else " (eager)")
            b, t, w = us["bf16" + suffix], us["tensor" + suffix], us["row" + suffix]
            print(f"| {case} | {r['tokens']} | {fmt(b)} | {fmt(t)} | {fmt(w)} | {fmt(speedup(b, t), 2)} | "
                  f"{fmt(speedup(b, w), 2)} | {r['err']['tensor']:.3f} | {r['err']['row']:.3f} |")
            if r["case"] == "train" and world == 2:
                for name, value in (("tensor", t), ("row", w)):
                    s = speedup(b, value)
                    summary.append((f"block fwd+bwd {r['tokens']} tokens, world {world}, {name}", s, TARGETS["block"],
                                    s is not None and s >= TARGETS["block"]))
    for r in [next(r for r in rows if r["case"] == case) for case in dict.fromkeys(r["case"] for r in rows)]:
        for name, impls in r["impls"].items():
            print(f"fusions ({name}, {r['case']}): {impls}")


def print_grouped(rows, summary):
    print("\nGrouped GEMM (MoE), one GPU: microseconds per call (ratio = bf16 / FP8)")
    print("| tokens | pass | bf16 | FP8 tensor | FP8 row | tensor speedup | row speedup |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        us = r["us"]
        for suffix, label in (("", "forward"), (":fwd+bwd", "fwd+bwd")):
            b, t, w = us["bf16" + suffix], us["tensor" + suffix], us["row" + suffix]
            print(f"| {r['tokens']} | {label} | {fmt(b)} | {fmt(t)} | {fmt(w)} | {fmt(speedup(b, t), 2)} | "
                  f"{fmt(speedup(b, w), 2)} |")
        b, f = us.get("gemm:bf16"), us.get("gemm:fp8")
        print(f"| {r['tokens']} | GEMM alone | {fmt(b)} | - | {fmt(f)} | - | {fmt(speedup(b, f), 2)} |")
        if r is rows[0]:
            for name in ("tensor", "row"):
                s = speedup(us["bf16"], us[name])
                summary.append((f"grouped forward {r['tokens']} tokens, {name}", s, TARGETS["grouped"],
                                s is not None and s >= TARGETS["grouped"]))
    print(f"impls: {rows[0]['impls']}; relative error vs bf16: "
          + ", ".join(f"T={r['tokens']} {k} {v:.3f}" for r in rows for k, v in r["err"].items()))


def print_training(rows, summary):
    print("\nShort training run (bench/fp8_training.py): loss, mean of the last 10 steps")
    print("| variant | first loss | final loss | vs bf16 | seconds |\n|---|---|---|---|---|")
    base = rows[0]["final"]
    for r in rows:
        diff = (r["final"] - base) / base
        print(f"| {r['variant']} | {r['first']:.4f} | {r['final']:.4f} | {diff:+.2%} | {r['seconds']:.0f} |")
        if r["variant"] != "bf16":
            summary.append((f"training run final loss, {r['variant']} vs bf16", abs(diff), TARGETS["loss"],
                            abs(diff) <= TARGETS["loss"]))


def main(argv=None) -> int:
    parser = common.parser("fp8", __doc__)
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    parser.add_argument("--only", nargs="+", choices=["block", "grouped", "training"],
                        default=["block", "grouped", "training"])
    args = parser.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    started = time.perf_counter()

    def measure():
        if torch.cuda.get_device_capability() < (8, 9):
            major, minor = torch.cuda.get_device_capability()
            print(f"no FP8: fp8 needs FP8 tensor cores (sm89+), this GPU is sm{major}{minor}; skipped")
            return None
        o = QUICK if args.quick else FULL
        results = {}
        if "block" in args.only:
            for world in common.worlds(args.world):
                results[f"block{world}"] = common.run_ranks(block_worker, world, o, backend="nccl")
        if "grouped" in args.only:
            results["grouped"] = grouped_rows(o)
        if "training" in args.only:
            results["training"] = training_rows(o)
        return {"opts": o, "device": torch.cuda.get_device_name(), "results": results}

    data = common.results(args, "fp8", 1, measure)
    if data is None:
        return 0
    summary, results = [], data["results"]
    print(f"{data['device']}, {', '.join(f'{k}={v}' for k, v in data['opts'].items() if k in ('hidden', 'ffn'))}")
    for key in sorted(k for k in results if k.startswith("block")):
        print_block(int(key[len("block"):]), results[key], summary)
    if "grouped" in results:
        print_grouped(results["grouped"], summary)
    if "training" in results:
        print_training(results["training"], summary)
    print(f"\nsummary (targets of issue 17; {time.perf_counter() - started:.0f} s)")
    print("| measure | value | target | met |\n|---|---|---|---|")
    for what, value, target, met in summary:
        print(f"| {what} | {fmt(value, 3)} | {target} | {'yes' if met else 'NO'} |")
    common.finish(args, data, bars={what: value for what, value, _t, _m in summary if value is not None},
                  title="FP8 vs bf16 (speedups; loss: relative difference)", xlabel="value")
    return 0


if __name__ == "__main__":
    sys.exit(main())
