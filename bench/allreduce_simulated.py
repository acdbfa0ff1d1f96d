"""The peer all-reduce + add + RMSNorm kernels on *simulated ranks*: W regions in one GPU's memory,
one stream per rank (tests/gpu/test_residual_norm_kernels.py's protocol tests, timed).

    PYTHONPATH=. python3 bench/allreduce_simulated.py [--world 2] [--hidden 8192] [--tokens 1 4 16 64 256]

What it measures: a kernel version's own cost without NVLink (launch, call state, polls, the norm,
the HBM traffic of pushes, clears and write-backs), for an A/B of two kernel versions (run it once
per build, e.g. with another OPFUSE_CACHE_DIR and PYTHONPATH) when no multi-GPU machine is lent.
What it does not: the transfer's latency and bandwidth between GPUs (here every "remote" store is
local), so absolute times are not the multi-GPU ones (bench/allreduce_norm.py). Each rank's grid is
capped so that every rank's kernel is resident at once ((SMs - 4) / W blocks, half that with PDL,
where a rank's next grid may be resident too). Per size: a CUDA graph of CALLS calls on every rank,
median of REPLAYS replays, us per call; ``OPFUSE_PDL`` and the kernel's tuning knobs apply.
``--timeline`` adds rank 0's one-shot phase timeline (bench/allreduce_timeline.py) per size.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import opfuse  # noqa: E402
import common  # noqa: E402  (bench/common.py)
from timing import median  # noqa: E402  (bench/timing.py)

CALLS, REPLAYS = 40, 15
KINDS = ("oneshot", "lamport")


def measure_size(ext, kind: str, world: int, tokens: int, hidden: int, pdl: bool, timeline: bool = False):
    """us per call; with ``timeline`` (one-shot) also rank 0's phase table (bench/allreduce_timeline.py's
    phase_table of one replay, from a second graph captured with the stamps on)."""
    dtype = torch.bfloat16
    code = ext.DTYPES["bfloat16"]
    capacity = tokens * hidden * 2
    size = getattr(ext, f"{kind}_region_bytes")(world, capacity)
    buffers = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(world)]
    peers = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device="cuda")
    regions = [ext.PeerRegion(peers.data_ptr(), b.data_ptr(), r, world, size, capacity) for r, b in enumerate(buffers)]
    for region in regions:
        getattr(ext, f"{kind}_init")(region, code, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = max(1, (sms - 4) // (world * (2 if pdl else 1)))
    xs = [torch.randn(tokens, hidden, device="cuda", dtype=dtype) for _ in range(world)]
    residual = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    weight = torch.ones(hidden, device="cuda", dtype=dtype)
    ys = [torch.empty_like(x) for x in xs]
    hs = [torch.empty_like(x) for x in xs]
    watches = [ext.PeerWatch() for _ in range(world)]
    streams = [torch.cuda.Stream() for _ in range(world)]
    launch = getattr(ext, f"allreduce_{kind}")

    def calls(n):
        for stream in streams:
            stream.wait_stream(torch.cuda.current_stream())
        for _ in range(n):
            for r in range(world):
                args = (xs[r].data_ptr(), 0, residual.data_ptr(), weight.data_ptr(), 0, ys[r].data_ptr(),
                        hs[r].data_ptr(), tokens, hidden, 1e-6, ext.NORMS["rms"], code, regions[r],
                        watches[r].flag, watches[r].record, 2_000_000_000, 0)
                launch(*args, grid, streams[r].cuda_stream, pdl=pdl)
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)

    def timed_graph():
        calls(3)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            calls(CALLS)
        graph.replay()
        times = []
        for _ in range(REPLAYS):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / CALLS)
        for r, watch in enumerate(watches):
            if watch.failed():
                raise RuntimeError(f"simulated rank {r} waited past the timeout: {watch.read()}")
        return graph, median(times)

    graph, us = timed_graph()
    del graph
    if not timeline:
        return us, None
    import allreduce_timeline

    stamps = torch.zeros(ext.TIMELINE_CALLS, ext.CALL_SLOTS, ext.TIMELINE_PHASES, dtype=torch.int64, device="cuda")
    regions[0].set_timeline(stamps.data_ptr())  # captured into the next graph's kernel parameters
    try:
        graph, _ = timed_graph()
        stamps.zero_()
        graph.replay()
        torch.cuda.synchronize()
        phases = allreduce_timeline.phase_table(stamps.cpu())
        del graph
    finally:
        regions[0].set_timeline(0)
    return us, phases


def main() -> int:
    parser = common.parser("allreduce_simulated", __doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, nargs="+", default=[8192])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=["oneshot"])
    parser.add_argument("--label", default="", help="a name for this build in the table (e.g. the commit)")
    parser.add_argument("--timeline", action="store_true",
                        help="also rank 0's one-shot phase timeline per size (bench/allreduce_timeline.py's phases)")
    args = parser.parse_args()

    def measure():
        from opfuse.runtime import extension

        ext = extension.load("residual_norm")
        pdl = opfuse.config.pdl
        rows = []
        for kind in args.kinds:
            for hidden in args.hidden:
                for tokens in args.tokens:
                    us, phases = measure_size(ext, kind, args.world, tokens, hidden, pdl,
                                              timeline=args.timeline and kind == "oneshot")
                    rows.append({"kind": kind, "hidden": hidden, "tokens": tokens, "us": us, "pdl": pdl,
                                 "label": args.label, "phases": phases})
                    common.progress(f"{kind} hidden {hidden} tokens {tokens}: {us:.2f} us")
        return rows

    rows = common.results(args, "allreduce_simulated", 1, measure)
    if rows is None:
        return 0
    print(f"simulated ranks (world {args.world}, one GPU), us per call, CUDA graph of {CALLS} calls, median of "
          f"{REPLAYS}; build {rows[0]['label'] or '-'}, PDL {'on' if rows[0]['pdl'] else 'off'}")
    print("| kind | hidden | tokens | us |")
    for r in rows:
        print(f"| {r['kind']} | {r['hidden']} | {r['tokens']} | {r['us']:.2f} |")
    timed = [r for r in rows if r.get("phases")]
    if timed:
        names = ("state", "pushed", "arrived", "all in", "summed", "reduced", "row", "end", "next", "gap")
        print("rank 0's one-shot phases, us from the call's first block entry (earliest..latest block)")
        print("| hidden | tokens | " + " | ".join(names) + " |")
        for r in timed:
            cells = [f"{r['phases'][n][0]:.2f}..{r['phases'][n][1]:.2f}" if n in r["phases"] else "-" for n in names]
            print(f"| {r['hidden']} | {r['tokens']} | " + " | ".join(cells) + " |")
    common.finish(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
