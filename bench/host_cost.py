"""Host time per call of the ops an FP8 training step issues, next to their GPU time (issue 27).

An FP8 step of small layers is host-bound without CUDA graphs (docs/PERF_NOTES.model.md, sessions
25-26). This times, per call: ``torch.mm`` (bf16, what torch.compile's bf16 step calls) against
``torch._scaled_mm`` (FP8, one scale per tensor) on the 16-layer small model's GEMM shapes, and the
power-of-two weight cast alone (``quantize_weight``) against the batched cast of 16 weights
(``quantize_weights``); the weight cast, the activation cast and the add + RMSNorm + quantize with
opfuse's cached Triton launches and through Triton's own launch path
(``OPFUSE_TRITON_LAUNCH_CACHE``, opfuse/runtime/triton_launch.py). Host time: the wall time of
issuing ``--calls`` calls back to back without a synchronisation, divided by the calls (the GPU
queue never fills at these counts); GPU time: CUDA
events around the same calls after a synchronisation (where the host is slower than the kernels it
launches, the GPU waits and this reads as the host time).

    python3 bench/host_cost.py [--calls 200] [--rounds 6] [--profile]

``--profile`` adds, per cast, torch.profiler's table of 20 calls (CPU and CUDA time per op and
kernel): whether a cast's time is the host's or the GPU's, and which piece.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import timing  # bench/timing.py (this script's folder is on the path)


def _timed(fn, calls: int) -> tuple[float, float]:
    """``(host us per call, GPU us per call)`` of ``fn``."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host, timing.interleaved_us({"fn": lambda i: fn()}, reps=1, calls=calls, warmup=0)["fn"]


def _profile(name: str, fn, calls: int = 20) -> None:
    """torch.profiler's op table over ``calls`` calls of ``fn`` (warmed up first)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    print(f"profile of {name}, {calls} calls:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="torch.profiler tables of 20 calls of each cast")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of the cached / uncached casts, order "
                        "alternating; medians (default %(default)s)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("host_cost: needs a GPU; skipped")
        return
    import opfuse
    from opfuse.families.quantize import kernels as quantize_kernels
    from opfuse.families.quantize import weight_pow2
    from opfuse.families.residual_norm.fp8 import triton_impl as norm_quantize

    dev = "cuda"
    rows = []
    # (tokens, in features, out features) of the small model's GEMMs: q/o, k/v, gate/up, down
    for m, k, n in [(2048, 2048, 2048), (2048, 2048, 512), (2048, 2048, 8192), (2048, 8192, 2048)]:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev)
        rows.append((f"mm bf16 {m}x{k}x{n}", *_timed(lambda: torch.mm(a, b.t()), args.calls)))
        rows.append((f"_scaled_mm fp8 {m}x{k}x{n}", *_timed(
            lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16), args.calls)))
    weights = [torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16) for _ in range(16)]
    weight_pow2.reserve_hint("host-cost-one", torch.device(dev))
    weight_pow2.reserve_hint("host-cost-batch", torch.device(dev), len(weights))
    x = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    res, w = torch.randn_like(x), torch.ones(2048, device=dev, dtype=torch.bfloat16)
    casts = [
        ("quantize_weight 2048x2048 (one)", args.calls,
         lambda: weight_pow2.quantize_weight(weights[0], torch.float8_e4m3fn, True, "host-cost-one")),
        ("quantize_weights 16 x 2048x2048 (one call)", max(1, args.calls // 4),
         lambda: weight_pow2.quantize_weights(weights, torch.float8_e4m3fn, True, "host-cost-batch")),
        ("quantize (activation, amax + cast) 2048x2048", args.calls,
         lambda: quantize_kernels.quantize(x, torch.float8_e4m3fn, False)),
        ("add + RMSNorm + quantize 2048x2048", args.calls,
         lambda: norm_quantize.forward(x, None, res, w, None, 1e-6, True, "e4m3", False, "", norm="rms")),
    ]
    # Cached and Triton's launches alternate, the order swapped every round (A B B A ...), and each
    # row is the median of the rounds: one pass each (sessions 27-28) ran the first-timed way slower
    # or faster by up to 60 us per call depending on what ran before it.
    launch_ways = (("cached launches", True), ("Triton's launch path", False))
    timed = {}
    for round_ in range(args.rounds):
        for launches, cached in launch_ways if round_ % 2 == 0 else launch_ways[::-1]:
            with opfuse.config.override(triton_launch_cache=cached):
                for name, calls, fn in casts:
                    timed.setdefault((name, launches), []).append(_timed(fn, calls))
    for name, _calls, _fn in casts:
        for launches, _cached in launch_ways:
            runs = timed[(name, launches)]
            rows.append((f"{name}, {launches}", statistics.median(h for h, _ in runs),
                         statistics.median(g for _, g in runs)))
    if args.profile:
        _profile("quantize_weight 2048x2048 (one)",
                 lambda: weight_pow2.quantize_weight(weights[0], torch.float8_e4m3fn, True, "host-cost-one"))
        _profile("quantize_weights 16 x 2048x2048 (one call)",
                 lambda: weight_pow2.quantize_weights(weights, torch.float8_e4m3fn, True, "host-cost-batch"))
        _profile("quantize (activation) 2048x2048", lambda: quantize_kernels.quantize(x, torch.float8_e4m3fn, False))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; {args.calls} calls each "
          f"(the casts: median of {args.rounds} rounds, cached and Triton's launches alternating)")
    print("| op | host us / call | GPU us / call |")
    print("|---|---|---|")
    for name, host, gpu in rows:
        print(f"| {name} | {host:.1f} | {gpu:.1f} |")


if __name__ == "__main__":
    main()
