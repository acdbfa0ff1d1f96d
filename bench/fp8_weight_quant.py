"""One weight's FP8 quantization per training step (W and W.T in E4M3, one scale), on one GPU.

    PYTHONPATH=. python3 bench/fp8_weight_quant.py [--json FILE]

The weights are the per-rank shards of bench/model.py's hidden-8192 model at world 2 (q/k/v merged,
o, gate/up merged, down), bf16. Variants, each timed as a CUDA graph of CALLS calls, replays
interleaved:

* ``inductor``: what the compile front end writes for ``TensorScaling()`` today:
  ``fp8_aten.quantize(W, e4m3, transpose=True)`` compiled by Inductor (amax reduction, scale, cast,
  transposed copy: ~7 bytes of traffic per element);
* ``triton 2-pass``: opfuse's amax kernel, then one cast writing W and W.T (6 bytes; the exact
  recipe's own kernels);
* ``1-read, hint right``: ``TensorScaling(pow2_weight_scales=True)``'s quantizer in its steady
  state (the exponent of the previous call holds: 4 bytes);
* ``1-read, hint wrong``: the same without a hint (a fresh one each call, never right: cast, then
  cast again; includes the hint's 4-byte fill);
* floor: a copy of W (2 bytes read + 2 written, the one-read quantizer's traffic) at the copy rate
  measured in the same run.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402  (bench/common.py)
import timing  # noqa: E402  (bench/timing.py)

#: (name, rows, cols) per rank at world 2 (hidden 8192, 64 heads / 8 kv heads of 128, ffn 28672).
WEIGHTS = (("qkv", 5120, 8192), ("o", 8192, 4096), ("gate_up", 28672, 8192), ("down", 8192, 14336))
CALLS, REPLAYS = 10, 5
E4M3 = torch.float8_e4m3fn


def measure() -> dict:
    from opfuse.families.quantize import kernels, weight_pow2
    from opfuse.fp8 import numerics
    from opfuse.torch_compile import fp8_aten

    rows = []
    inductor = torch.compile(lambda w: fp8_aten.quantize(w, E4M3, True), dynamic=False)
    for name, n, k in WEIGHTS:
        w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        copy = torch.empty_like(w)
        want = numerics.quantize(w, E4M3, False, pow2=True)
        got, got_t = weight_pow2.quantize_weight(w, E4M3, True, key=("bench", name))
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), name
        assert torch.equal(got_t.data.view(torch.uint8), want.data.t().contiguous().view(torch.uint8)), name
        fns = {"copy": lambda: copy.copy_(w),
               "inductor": lambda: inductor(w),
               "triton 2-pass": lambda: kernels.quantize(w, E4M3, False, transpose=True),
               "1-read, hint right": lambda: weight_pow2.quantize_weight(w, E4M3, True, key=("bench", name)),
               "1-read, hint wrong": lambda: weight_pow2.quantize_weight(w, E4M3, True, key=None)}
        for fn in fns.values():
            fn()
        times = timing.graphs_replay_us(fns, CALLS, REPLAYS)
        row = {"weight": name, "shape": [n, k], **{v: timing.median(t) for v, t in times.items()}}
        row["copy GB/s"] = 4 * n * k / row["copy"] / 1e3
        rows.append(row)
        common.progress(f"{name}: " + ", ".join(f"{v} {row[v]:.1f} us" for v in fns))
    return {"rows": rows, "gpu": torch.cuda.get_device_name()}


def table(data: dict) -> str:
    variants = ("inductor", "triton 2-pass", "1-read, hint right", "1-read, hint wrong")
    out = [f"one weight's W + W.T in E4M3 per step, us ({data['gpu']}); floor = a bf16 copy of W "
           f"(the one-read traffic, 4 bytes per element)",
           "| weight | shape | floor (copy) | " + " | ".join(variants) + " | 1-read right / inductor |",
           "|" + "---|" * (4 + len(variants))]
    total = {v: 0.0 for v in ("copy",) + variants}
    for r in data["rows"]:
        for v in total:
            total[v] += r[v]
        out.append(f"| {r['weight']} | {r['shape'][0]}x{r['shape'][1]} | {r['copy']:.1f} | "
                   + " | ".join(f"{r[v]:.1f}" for v in variants)
                   + f" | {r['1-read, hint right'] / r['inductor']:.2f} |")
    out.append("| one layer | | " + f"{total['copy']:.1f} | " + " | ".join(f"{total[v]:.1f}" for v in variants)
               + f" | {total['1-read, hint right'] / total['inductor']:.2f} |")
    return "\n".join(out)


def main() -> int:
    parser = common.parser("fp8_weight_quant", __doc__)
    args = parser.parse_args()
    data = common.results(args, "fp8_weight_quant", 1, measure)
    if data is None:
        return 0
    print(table(data))
    common.finish(args, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
