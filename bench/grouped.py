"""Grouped GEMM (MoE) benchmark: opfuse GroupedLinear vs torch._grouped_mm, a loop of mm over host
group sizes, and a dense GEMM of equal FLOPs, measured in one run on one GPU.

    PYTHONPATH=. python3 bench/grouped.py [--reps 5] [--calls 10] [--no-backward] [--json FILE] [--plot FILE.png]

Shapes: the ANCHORS.md one (32 experts, 32768 routed tokens, K=7168, N=2048, bf16) and a
decode-like one (32 experts, 256 tokens: 8 per expert on average). Routing is random (seeded),
so groups are uneven. Timing: CUDA events around ``--calls`` back-to-back eager calls, median of
``--reps``, after warm-up (kernels compiled). "ours" is ``ops.Sequential(GroupedLinear)`` with the
implementation the dispatch table chose; every opfuse implementation is also timed on its own.
Ratios are throughput ratios (baseline time / our time; > 1 means faster). The last table is the
summary against the targets.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (bench/common.py)
import opfuse  # noqa: E402
from opfuse import ops  # noqa: E402
from opfuse.backend import implementations  # noqa: E402
from opfuse.backend.registry import CallSpec  # noqa: E402

IMPLS = ["triton_tma", "torch_grouped_mm", "triton"]


def timed(fn, reps: int, calls: int) -> float:
    """Median microseconds per call."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def routing(tokens: int, experts: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    choice = torch.randint(0, experts, (tokens,), generator=gen)
    return torch.bincount(choice, minlength=experts).tolist()


def spec(x, counts, w):
    meta = opfuse.ops.TensorMeta
    return CallSpec("grouped_linear", {"x": meta.of(x), "group_sizes": meta.of(counts),
                                                 "weight": meta.of(w), "bias": None}, {"fsdp": False})


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bench_shape(name, tokens, experts, k, n, args) -> dict:
    dtype, dev = torch.bfloat16, "cuda"
    sizes = routing(tokens, experts, seed=tokens)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, k, device=dev, dtype=dtype, generator=gen)
    w = torch.randn(experts, n, k, device=dev, dtype=dtype, generator=gen) / math.sqrt(k)
    counts = torch.tensor(sizes, device=dev, dtype=torch.int32)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    dense_w = torch.randn(n, k, device=dev, dtype=dtype, generator=gen) / math.sqrt(k)
    flops = 2.0 * tokens * k * n
    weight_bytes = w.numel() * w.element_size()

    layer = ops.GroupedLinear(experts, k, n, device=dev, dtype=dtype).requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(w)
    block = ops.Sequential(layer)
    chosen = block.program(x, counts).fusions[0].impl

    y_torch = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    bounds, start = [], 0
    for c in sizes:
        bounds.append((start, start + c))
        start += c
    y_loop = torch.empty(tokens, n, device=dev, dtype=dtype)

    def loop_mm():
        for g, (s, e) in enumerate(bounds):
            torch.mm(x[s:e], w[g].t(), out=y_loop[s:e])

    rows = {}
    with torch.no_grad():
        err = rel(block(x, counts), y_torch)
        rows["torch._grouped_mm"] = timed(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
                                          args.reps, args.calls)
        rows["loop of mm (host sizes)"] = timed(loop_mm, args.reps, args.calls)
        rows["dense GEMM, equal FLOPs"] = timed(lambda: torch.mm(x, dense_w.t()), args.reps, args.calls)
        rows[f"ours (GroupedLinear -> {chosen})"] = timed(lambda: block(x, counts), args.reps, args.calls)
        for impl in IMPLS:
            entry = implementations.get("grouped_linear", impl)
            reason = entry.check(spec(x, counts, w))
            if reason:
                print(f"  [{name}] {impl}: not capable here ({reason})")
                continue
            y = entry.forward(x, counts, w, None)
            print(f"  [{name}] {impl}: rel. diff vs torch._grouped_mm {rel(y, y_torch):.2e}")
            rows[f"  opfuse impl {impl}"] = timed(lambda: entry.forward(x, counts, w, None), args.reps, args.calls)

    result = {"name": name, "rows": rows, "flops": flops, "bytes": weight_bytes, "chosen": chosen, "err": err,
              "sizes": sizes}
    if not args.no_backward and name == "large":
        result["train"] = bench_training(x, counts, offs, w, layer, args)
    return result


def bench_training(x, counts, offs, w, layer, args) -> dict:
    """Forward + backward (dx and dW): ours vs torch._grouped_mm's autograd."""
    layer.requires_grad_(True)
    block = ops.Sequential(layer)
    xg = x.detach().clone().requires_grad_()
    wt = w.detach().clone().requires_grad_()
    dy = torch.randn(x.shape[0], w.shape[1], device=x.device, dtype=x.dtype)

    def ours():
        xg.grad, layer.weight.grad = None, None
        block(xg, counts).backward(dy)

    def theirs():
        xg.grad, wt.grad = None, None
        torch._grouped_mm(xg, wt.transpose(-2, -1), offs=offs).backward(dy)

    reps, calls = args.reps, max(1, args.calls // 2)
    return {"ours": timed(ours, reps, calls), "torch._grouped_mm": timed(theirs, reps, calls),
            "impl": block.program(xg, counts).fusions[0].impl}


def report(res) -> None:
    rows, flops = res["rows"], res["flops"]
    base, dense = rows["torch._grouped_mm"], rows["dense GEMM, equal FLOPs"]
    sizes = res["sizes"]
    print(f"\n{res['name']}: {len(sizes)} experts, {sum(sizes)} tokens (per expert {min(sizes)}..{max(sizes)}), "
          f"weights {res['bytes'] / 2**20:.0f} MiB; ours vs torch rel. diff {res['err']:.2e}")
    print(f"  {'method':34s} {'us':>9s} {'TFLOP/s':>8s} {'weight GB/s':>11s} {'vs grouped_mm':>13s} {'vs dense':>9s}")
    for label, us in rows.items():
        # The dense GEMM reads one expert's weight, not all of them: no weight bandwidth to quote.
        gbs = "-" if label.startswith("dense") else f"{res['bytes'] / us / 1e3:.0f}"
        print(f"  {label:34s} {us:9.1f} {flops / us / 1e6:8.1f} {gbs:>11s} {base / us:13.2f}x {dense / us:8.2f}x")
    if "train" in res:
        t = res["train"]
        theirs = t["torch._grouped_mm"]
        print(f"  fwd+bwd: ours ({t['impl']}) {t['ours']:.1f} us, torch._grouped_mm autograd {theirs:.1f} us "
              f"({theirs / t['ours']:.2f}x)")


def summary(results) -> None:
    print("\nsummary (throughput ratios, same run; targets from shared/ANCHORS.md)")
    print(f"  {'shape':8s} {'ours us':>9s} {'TFLOP/s':>8s} {'vs grouped_mm':>14s} {'target':>7s} "
          f"{'vs dense':>9s} {'target':>7s}")
    for res in results:
        rows = res["rows"]
        ours = next(us for label, us in rows.items() if label.startswith("ours"))
        vs_torch = rows["torch._grouped_mm"] / ours
        vs_dense = rows["dense GEMM, equal FLOPs"] / ours
        dense_target = ">=0.90" if res["name"] == "large" else "-"
        print(f"  {res['name']:8s} {ours:9.1f} {res['flops'] / ours / 1e6:8.1f} {vs_torch:13.2f}x {'>=1.00':>7s} "
              f"{vs_dense:8.2f}x {dense_target:>7s}")


def ratio_series(results) -> dict:
    """The chart: opfuse's throughput over torch._grouped_mm's and the dense GEMM's, against tokens."""
    series = {}
    for res in results:
        ours = next(us for label, us in res["rows"].items() if label.startswith("ours"))
        tokens = sum(res["sizes"])
        for label, base in (("torch._grouped_mm time / opfuse time", "torch._grouped_mm"),
                            ("dense GEMM time / opfuse time", "dense GEMM, equal FLOPs")):
            series.setdefault(label, []).append((tokens, res["rows"][base] / ours))
    return series


def main(argv=None) -> int:
    parser = common.parser("grouped", __doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--no-backward", action="store_true", help="skip the fwd+bwd comparison")
    args = parser.parse_args(argv)
    begin = time.perf_counter()

    def measure():
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        shapes = []
        for name, tokens in (("large", 32768), ("decode", 256)):
            shapes.append(bench_shape(name, tokens, 32, 7168, 2048, args))
            common.progress(f"{name} ({tokens} tokens) done")
        return shapes

    results = common.results(args, "grouped", 1, measure)
    if results is None:
        return 0
    for res in results:
        report(res)
    summary(results)
    print(f"(total {time.perf_counter() - begin:.0f} s)")
    common.finish(args, results, series=ratio_series(results), xlabel="routed tokens",
                  ylabel="throughput ratio (> 1: opfuse faster)", title="grouped GEMM (32 experts, K=7168, N=2048)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
