"""Host overhead of a compiled ``ops.Sequential`` call against calling the same ops directly.

    PYTHONPATH=. python3 bench/host_overhead.py [--device cpu|cuda] [--tokens 1] [--json FILE] [--plot FILE.png]

Both sides run the same unfused basic ops on tiny tensors (so op time is small and the
difference is opfuse's Python cost per call: signature check, cache lookup, GraphModule call),
plus the fused program for reference. Best of 7 repetitions of many calls (host timings on a
shared machine are noisy upwards), microseconds. Target (issue 3): at most 10 us added per call.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (bench/common.py)

import opfuse  # noqa: E402
from opfuse import ops  # noqa: E402


def block(hidden, device):
    return ops.Sequential(ops.RMSNorm(hidden, device=device), ops.Linear(hidden, 4 * hidden, device=device), ops.GELU(),
                          ops.Linear(4 * hidden, hidden, device=device), ops.AddExtraInput(), ops.MakeExtraOutput(),
                          ops.RMSNorm(hidden, device=device))


def per_call_us(fn, calls, repeats, sync):
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e6 / calls)
    return min(samples)


def main() -> int:
    parser = common.parser("host_overhead", __doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    if args.from_json:
        report(common.load_json(args.from_json), args)
        return 0
    if args.device == "cuda" and common.skip_without_gpus("host_overhead --device cuda", 1):
        return 0
    torch.set_num_threads(1)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    seq = block(args.hidden, args.device)
    x = torch.randn(args.tokens, args.hidden, device=args.device)
    res = torch.randn(args.tokens, args.hidden, device=args.device)
    basic = [op for op in seq]

    def direct():
        h = x
        for op in basic[:4]:
            h = op(h)
        h = basic[4](h, res)
        h = basic[5](h)
        return basic[6](h), h

    rows = []
    with torch.no_grad():
        for label, fuse in (("unfused program", False), ("fused program", True)):
            with opfuse.config.override(fuse=fuse):
                seq(x, res)  # compile outside the timing
                program = opfuse.compile(seq, x, res)
                compiled = per_call_us(lambda: seq(x, res), args.calls, 7, sync)
                bare = per_call_us(lambda: program.graph_module(x, res), args.calls, 7, sync)
            rows.append((label, compiled, bare))
            common.progress(f"{label} done")
        direct_us = per_call_us(direct, args.calls, 7, sync)
    data = {"device": args.device, "tokens": args.tokens, "hidden": args.hidden, "calls": args.calls,
            "torch": torch.__version__, "direct": direct_us,
            "rows": [{"path": label, "seq": compiled, "graph_module": bare} for label, compiled, bare in rows]}
    report(data, args)
    return 0


def report(data, args) -> None:
    """Print the table (and --json, --plot) of one run."""
    direct_us = data["direct"]
    rows = [(r["path"], r["seq"], r["graph_module"]) for r in data["rows"]]
    print(f"host overhead, {data['device']}, tokens={data['tokens']}, hidden={data['hidden']}, torch {data['torch']}, "
          f"best of 7 x {data['calls']} calls (us per call)")
    print("| path | seq(x, res) | GraphModule only | seq - direct ops |")
    print("|---|---|---|---|")
    print(f"| direct calls of the basic ops | {direct_us:.1f} | - | - |")
    for label, compiled, bare in rows:
        extra = compiled - direct_us if label == "unfused program" else float("nan")
        print(f"| {label} | {compiled:.1f} | {bare:.1f} | {extra:+.1f} |")
    print(f"added per call by opfuse (unfused program vs direct): {rows[0][1] - direct_us:+.1f} us "
          f"(target <= 10 us); of which Sequential dispatch (signature, cache lookup): "
          f"{rows[0][1] - rows[0][2]:.1f} us")
    bars = {"direct calls of the basic ops": direct_us}
    bars.update({f"{label}: seq(x, res)": compiled for label, compiled, _ in rows})
    bars.update({f"{label}: GraphModule only": bare for label, _, bare in rows})
    common.finish(args, data, bars=bars, ylabel="us per call (host)",
                  title=f"host cost of one call, {data['device']}, tokens={data['tokens']}")


if __name__ == "__main__":
    sys.exit(main())
