"""Horizontal GEMM fusion: the gate and up projections of a gated MLP as two GEMMs (what Hugging
Face's LlamaMLP runs on separate weights) against one GEMM over both (what the ``horizontal_gemm``
pass makes of ``ops.GatedLinear``), at one rank's shapes, on one GPU, in one run.

    PYTHONPATH=. python3 bench/horizontal.py                    # hidden 8192, ffn 28672, world 1 2 4 8
    PYTHONPATH=. python3 bench/horizontal.py --world 2 --quick  # smaller sizes, a smoke test

Shapes: x ``[tokens, hidden]``, gate and up ``[ffn / world, hidden]`` each (a column-parallel rank's
shards; no communication is timed), bf16. Tokens: decode 1, 16, 64 (forward, no grad) and prefill
2048, 8192 (forward, and forward + backward with gradients of x and both weights).

Columns (us per call; one CUDA graph of back-to-back calls per variant, 20 decode / 3 prefill calls;
median of 15 replays, the variants replayed in turn so that clock drift hits them alike):
  two GEMMs      ``F.linear(x, gate)``, ``F.linear(x, up)``
  one GEMM       ``F.linear(x, [gate; up])`` on a contiguous weight: the floor of the fused layer
  layer: torch   ``silu(F.linear(x, gate)) * F.linear(x, up)``
  layer: opfuse  ``ops.Sequential(ops.GatedLinear(...))``: one GEMM over the joined weight (a view
                 of the two parameters) + the activation, as compiled
  fused / two    one GEMM / two GEMMs; ``opfuse / torch`` the same for the whole layer

Without a GPU it prints one line and exits 0; ``--json`` / ``--plot`` / ``--from-json`` as every
benchmark (bench/common.py).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (bench/common.py)
from timing import graphs_replay_us, median  # noqa: E402  (bench/timing.py)

FULL = dict(hidden=8192, ffn=28672, decode=[1, 16, 64], prefill=[2048, 8192], calls_decode=20, calls_prefill=3,
            reps=15)
QUICK = dict(hidden=2048, ffn=8192, decode=[1, 16], prefill=[2048], calls_decode=10, calls_prefill=3, reps=5)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def measure(hidden: int, rows: int, tokens: int, train: bool, calls: int, reps: int) -> dict:
    """One shape: ``rows`` = ffn / world rows in each of gate and up."""
    from opfuse import ops

    torch.manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    layer = ops.GatedLinear(hidden, rows, **kw)
    block = ops.Sequential(layer)
    gate, up = layer.gate_weight, layer.up_weight
    joined = torch.cat([gate, up]).detach().requires_grad_(train)
    x = torch.randn(tokens, hidden, **kw).requires_grad_(train)
    dy_two = torch.randn(tokens, rows, **kw)
    dy_one = torch.randn(tokens, 2 * rows, **kw)
    leaves = [x, gate, up]

    def two():
        return F.linear(x, gate), F.linear(x, up)

    def one():
        return F.linear(x, joined)

    def torch_layer():
        return F.silu(F.linear(x, gate)) * F.linear(x, up)

    if train:
        cases = {
            "two GEMMs": lambda: torch.autograd.grad(two(), leaves, (dy_two, dy_two)),
            "one GEMM": lambda: torch.autograd.grad(one(), [x, joined], dy_one),
            "layer: torch": lambda: torch.autograd.grad(torch_layer(), leaves, dy_two),
            "layer: opfuse": lambda: torch.autograd.grad(block(x), leaves, dy_two),
        }
        context = torch.enable_grad
    else:
        cases = {"two GEMMs": two, "one GEMM": one, "layer: torch": torch_layer, "layer: opfuse": lambda: block(x)}
        context = torch.no_grad
    with context():
        row = {"err": rel(block(x), torch_layer())}
        program = block.program(x)
        row["fused"] = ", ".join(f"{f.rule}={f.impl}" for f in program.fusions) or "none"
        for name, times in graphs_replay_us(cases, calls, reps).items():
            row[name] = median(times)
    row["fused / two"] = row["one GEMM"] / row["two GEMMs"]
    row["opfuse / torch"] = row["layer: opfuse"] / row["layer: torch"]
    return row


COLUMNS = ["two GEMMs", "one GEMM", "fused / two", "layer: torch", "layer: opfuse", "opfuse / torch"]


def measure_all(opts: dict, worlds: list[int]) -> dict:
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hidden": opts["hidden"],
            "ffn": opts["ffn"], "rows": []}
    for world in worlds:
        cases = [("decode", t, False, opts["calls_decode"]) for t in opts["decode"]]
        cases += [(mode, t, mode == "prefill fwd+bwd", opts["calls_prefill"]) for t in opts["prefill"]
                  for mode in ("prefill fwd", "prefill fwd+bwd")]
        for case, tokens, train, calls in cases:
            row = measure(opts["hidden"], opts["ffn"] // world, tokens, train, calls, opts["reps"])
            data["rows"].append(dict(row, world=world, case=case, tokens=tokens))
            common.progress(f"world {world} {case} T={tokens}: done")
            torch.cuda.empty_cache()
    return data


def report(data: dict) -> None:
    print(f"{data['device']}, torch {data['torch']}; hidden {data['hidden']}, ffn {data['ffn']}, bf16")
    print("| world | case | tokens | " + " | ".join(COLUMNS) + " | rel err | fused |")
    print("|" + "---|" * (len(COLUMNS) + 5))
    for row in data["rows"]:
        cells = [f"{row[c]:.2f}" if "/" in c else f"{row[c]:.1f}" for c in COLUMNS]
        print(f"| {row['world']} | {row['case']} | {row['tokens']} | " + " | ".join(cells)
              + f" | {row['err']:.1e} | {row['fused']} |")


def ratio_series(data: dict) -> dict:
    series: dict = {}
    for row in data["rows"]:
        series.setdefault(f"world {row['world']} {row['case']}: opfuse layer / torch layer", []).append(
            (row["tokens"], row["opfuse / torch"]))
    return series


def main(argv=None) -> int:
    parser = common.parser("horizontal", __doc__)
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="tensor-parallel sizes whose per-rank shapes are timed (ffn / world rows each)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke test)")
    args = parser.parse_args(argv)
    begin = time.perf_counter()
    data = common.results(args, "horizontal", 1, lambda: measure_all(QUICK if args.quick else FULL, args.world))
    if data is None:
        return 0
    report(data)
    print(f"(total {time.perf_counter() - begin:.0f} s)")
    common.finish(args, data, series=ratio_series(data), xlabel="tokens",
                  ylabel="time ratio (< 1: opfuse faster)", title="gated layer: one GEMM over [gate; up] vs two")
    return 0


if __name__ == "__main__":
    sys.exit(main())
