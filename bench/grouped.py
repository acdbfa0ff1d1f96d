"""Grouped GEMM (MoE) benchmark: opfuse GroupedLinear vs torch._grouped_mm, a loop of mm over host
group sizes, and a dense GEMM of equal FLOPs, measured in one run on one GPU.

    PYTHONPATH=. python3 bench/grouped.py [--reps 7] [--calls 10] [--no-backward] [--json FILE] [--plot FILE.png]

Shapes: the ANCHORS.md one (32 experts, 32768 routed tokens, K=7168, N=2048, bf16) and a
decode-like one (32 experts, 256 tokens: 8 per expert on average). Routing is random (seeded),
so groups are uneven. Timing: CUDA events around ``--calls`` back-to-back eager calls, median of
``--reps``, every method timed round-robin within a rep (after a GPU warm-up, kernels compiled),
so clock drift does not favour whichever runs first. "ours" is ``ops.Sequential(GroupedLinear)``
with the implementation the dispatch chose; every capable opfuse implementation is also timed on
its own ("forced"). Ratios are throughput ratios (baseline time / our time; > 1 means faster).

Floors: the dense GEMM of equal FLOPs (large shape), and the weight bytes over the HBM bandwidth
measured here with a device-to-device copy (decode shape, which streams the weights). Forward +
backward (dx and dW, large shape): ours and every forced implementation against
``torch._grouped_mm`` with autograd. The last table is the summary against the issue's targets.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (bench/common.py)
import opfuse  # noqa: E402
from opfuse import ops  # noqa: E402
from opfuse.core import dispatch as implementations  # noqa: E402
from opfuse.machinery.implementation import CallSpec  # noqa: E402
from timing import device_copy_gbs, interleaved_us, warm_up_gpu  # noqa: E402  (bench/timing.py)

OP = "grouped_linear"
DEV = "cuda"


def gpu_impls() -> list[str]:
    """Every implementation of the table but the reference (which syncs)."""
    return [name for name in implementations.names()[OP] if name != "reference"]


def routing(tokens: int, experts: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    choice = torch.randint(0, experts, (tokens,), generator=gen)
    return torch.bincount(choice, minlength=experts).tolist()


def spec(x, counts, w, requires_grad=False):
    meta = opfuse.ops.TensorMeta
    return CallSpec(OP, {"x": meta.of(x), "group_sizes": meta.of(counts), "weight": meta.of(w), "bias": None},
                    {"fsdp": False}, requires_grad=requires_grad)


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:160] if text else type(error).__name__


def capable(x, counts, w, name: str, requires_grad=False):
    """The implementation ``name`` if it can run this call, else ``None`` (reason printed)."""
    entry = implementations.get(OP, name)
    reason = entry.check(spec(x, counts, w, requires_grad))
    if reason:
        print(f"  {name}: not capable here ({reason})")
        return None
    return entry


def bench_shape(name, tokens, experts, k, n, args, hbm_gbs) -> dict:
    dtype, dev = torch.bfloat16, DEV
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

    def loop_mm(i):
        for g, (s, e) in enumerate(bounds):
            torch.mm(x[s:e], w[g].t(), out=y_loop[s:e])

    fns = {
        "torch._grouped_mm": lambda i: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
        "loop of mm (host sizes)": loop_mm,
        "dense GEMM, equal FLOPs": lambda i: torch.mm(x, dense_w.t()),
        f"ours (GroupedLinear -> {chosen})": lambda i: block(x, counts),
    }
    with torch.no_grad():
        err = rel(block(x, counts), y_torch)
        for impl in gpu_impls():
            entry = capable(x, counts, w, impl)
            if entry is None:
                continue
            try:
                y = entry.forward(x, counts, w, None)
            except Exception as error:  # noqa: BLE001 - one implementation's failure is a line of the report
                print(f"  [{name}] {impl}: FAILED: {first_line(error)}")
                continue
            print(f"  [{name}] {impl}: rel. diff vs torch._grouped_mm {rel(y, y_torch):.2e}")
            fns[f"  forced {impl}"] = lambda i, entry=entry: entry.forward(x, counts, w, None)
        rows = interleaved_us(fns, args.reps, args.calls)

    result = {"name": name, "rows": rows, "flops": flops, "bytes": weight_bytes, "chosen": chosen, "err": err,
              "sizes": sizes, "hbm_gbs": hbm_gbs}
    if not args.no_backward and name == "large":
        result["train"] = bench_training(x, counts, offs, w, layer, args)
    return result


def bench_training(x, counts, offs, w, layer, args) -> dict:
    """Forward + backward (dx and dW): ours (autograd through the block), every capable
    implementation called directly, and torch._grouped_mm's autograd."""
    layer.requires_grad_(True)
    block = ops.Sequential(layer)
    xg = x.detach().clone().requires_grad_()
    wt = w.detach().clone().requires_grad_()
    dy = torch.randn(x.shape[0], w.shape[1], device=x.device, dtype=x.dtype)
    impl = block.program(xg, counts).fusions[0].impl

    def ours(i):
        xg.grad, layer.weight.grad = None, None
        block(xg, counts).backward(dy)

    def theirs(i):
        xg.grad, wt.grad = None, None
        torch._grouped_mm(xg, wt.transpose(-2, -1), offs=offs).backward(dy)

    def direct(entry):
        def run(i):
            entry.forward(x, counts, w, None)
            entry.backward(dy, x, counts, w, need_dx=True, need_dw=True, need_db=False)
        return run

    fns = {"torch._grouped_mm autograd": theirs, f"ours ({impl})": ours}
    for name in gpu_impls():
        entry = capable(x, counts, w, name, requires_grad=True)
        if entry is None:
            continue
        try:
            direct(entry)(0)
        except Exception as error:  # noqa: BLE001
            print(f"  [train] {name}: FAILED: {first_line(error)}")
            continue
        fns[f"  forced {name}"] = direct(entry)
    rows = interleaved_us(fns, args.reps, max(1, args.calls // 2))
    layer.requires_grad_(False)
    return {"rows": rows, "impl": impl}


def _ours(rows: dict) -> float:
    return next(us for label, us in rows.items() if label.startswith("ours"))


def _best_forced(rows: dict) -> tuple[str, float]:
    forced = {label.split()[-1]: us for label, us in rows.items() if label.strip().startswith("forced")}
    if not forced:
        return "-", float("nan")
    name = min(forced, key=forced.get)
    return name, forced[name]


def report(res) -> None:
    rows, flops = res["rows"], res["flops"]
    base, dense = rows["torch._grouped_mm"], rows["dense GEMM, equal FLOPs"]
    sizes = res["sizes"]
    print(f"\n{res['name']}: {len(sizes)} experts, {sum(sizes)} tokens (per expert {min(sizes)}..{max(sizes)}), "
          f"weights {res['bytes'] / 2**20:.0f} MiB; ours vs torch rel. diff {res['err']:.2e}")
    print(f"  {'method':38s} {'us':>9s} {'TFLOP/s':>8s} {'weight GB/s':>11s} {'vs grouped_mm':>13s} {'vs dense':>9s}")
    for label, us in rows.items():
        # The dense GEMM reads one expert's weight, not all of them: no weight bandwidth to quote.
        gbs = "-" if label.startswith("dense") else f"{res['bytes'] / us / 1e3:.0f}"
        print(f"  {label:38s} {us:9.1f} {flops / us / 1e6:8.1f} {gbs:>11s} {base / us:13.2f}x {dense / us:8.2f}x")
    if "train" in res:
        rows = res["train"]["rows"]
        theirs = rows["torch._grouped_mm autograd"]
        print("  forward + backward (dx, dW):")
        for label, us in rows.items():
            print(f"  {label:38s} {us:9.1f} {3 * flops / us / 1e6:8.1f} {'':>11s} {theirs / us:13.2f}x")


def summary(results) -> None:
    """One line per shape (and fwd+bwd): ours, the best forced implementation, and the targets."""
    print("\nsummary (throughput ratios, same run; targets from issue 22)")
    print(f"  {'case':13s} {'chosen':18s} {'ours us':>9s} {'best forced':>27s} {'vs grouped_mm':>13s} "
          f"{'target':>7s} {'floor':>26s} {'of floor':>8s} {'target':>7s}")
    for res in results:
        rows = res["rows"]
        ours = _ours(rows)
        best, best_us = _best_forced(rows)
        vs_torch = rows["torch._grouped_mm"] / ours
        if res["name"] == "large":
            floor_us, floor = rows["dense GEMM, equal FLOPs"], "dense equal FLOPs"
            torch_target, floor_target = ">=1.05", ">=0.98"
        else:
            floor_us, floor = res["bytes"] / res["hbm_gbs"] / 1e3, f"weights @ {res['hbm_gbs']:.0f} GB/s"
            torch_target, floor_target = "-", ">=0.90"
        print(f"  {res['name']:13s} {res['chosen']:18s} {ours:9.1f} {best:>18s} {best_us:8.1f} {vs_torch:12.2f}x "
              f"{torch_target:>7s} {floor:>17s} {floor_us:8.1f} {floor_us / ours:7.2f}x {floor_target:>7s}")
        if "train" in res:
            t = res["train"]["rows"]
            ours_t = _ours(t)
            best, best_us = _best_forced(t)
            vs = t["torch._grouped_mm autograd"] / ours_t
            print(f"  {res['name'] + ' fwd+bwd':13s} {res['train']['impl']:18s} {ours_t:9.1f} {best:>18s} "
                  f"{best_us:8.1f} {vs:12.2f}x {'>=1.00':>7s} {'-':>26s} {'-':>8s} {'-':>7s}")
    print("  (chosen within 3% of the best forced implementation is the dispatch target; 'of floor' = floor us / "
          "ours us)")


def ratio_series(results) -> dict:
    """The chart: opfuse's throughput over torch._grouped_mm's and the dense GEMM's, against tokens."""
    series = {}
    for res in results:
        ours = _ours(res["rows"])
        tokens = sum(res["sizes"])
        for label, base in (("torch._grouped_mm time / opfuse time", "torch._grouped_mm"),
                            ("dense GEMM time / opfuse time", "dense GEMM, equal FLOPs")):
            series.setdefault(label, []).append((tokens, res["rows"][base] / ours))
    return series


def main(argv=None) -> int:
    parser = common.parser("grouped", __doc__)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--no-backward", action="store_true", help="skip the fwd+bwd comparison")
    args = parser.parse_args(argv)
    begin = time.perf_counter()

    def measure():
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        warm_up_gpu()
        hbm = device_copy_gbs()
        print(f"HBM bandwidth (device-to-device copy, read + write): {hbm:.0f} GB/s")
        shapes = []
        for name, tokens in (("large", 32768), ("decode", 256)):
            shapes.append(bench_shape(name, tokens, 32, 7168, 2048, args, hbm))
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
