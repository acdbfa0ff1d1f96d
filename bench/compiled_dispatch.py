"""Host cost of opfuse's fused ops in compiled graphs: the custom op (``opfuse::<name>.default``,
with its autograd and ``torch.library.custom_op`` wrapper layers) against the ``direct`` overload
the graph pass now calls (``opfuse/torch_compile/direct_calls.py``).

    PYTHONPATH=. python3 bench/compiled_dispatch.py [--device cpu|cuda] [--calls 2000] [--rounds 7]

Two measurements, CPU time per call (``time.process_time``), best of ``--rounds`` interleaved rounds:

* one fused op called by itself (``add_rmsnorm``, reference implementation on 4 x 64 floats on
  CPU, the CUDA kernel on 4 x 64 bfloat16 on a GPU): ``default`` vs ``direct`` vs the op's
  function (``FusedCall.fn``) called from Python; the same for one FP8 graph op
  (``compiled_quantize``, reference on CPU, Triton on a GPU);
* a compiled block (all-reduce + residual add + RMSNorm, then a Linear, then add + RMSNorm: two
  fused ops, world 1, ``options={"inductor": False}`` so the graph runs op by op), inference and
  forward + backward, compiled with the direct overloads and with the graph pass's switch turned
  off (the custom ops as before).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import host_cpu_us  # noqa: E402  (bench/timing.py)

import opfuse  # noqa: E402
from opfuse.torch_compile import direct_calls, graph_pass  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, hidden: int, group):
        super().__init__()
        self.group = group
        self.norm1, self.norm2 = torch.nn.RMSNorm(hidden, eps=1e-6), torch.nn.RMSNorm(hidden, eps=1e-6)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, residual):
        import torch.distributed._functional_collectives as funcol

        h = funcol.all_reduce(x, "sum", self.group) + residual
        y = self.proj(self.norm1(h))
        h2 = y + h
        return self.norm2(h2), h2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo" if args.device == "cpu" else "nccl", store=dist.HashStore(), rank=0,
                                world_size=1)
    device = torch.device(args.device)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    sync = (lambda: None) if args.device == "cpu" else torch.cuda.synchronize
    impl = "reference" if args.device == "cpu" else "cuda"
    x, r = (torch.randn(4, 64, device=device, dtype=dtype) for _ in range(2))
    w = torch.randn(64, device=device, dtype=dtype)
    op_args = (x, None, r, w, None, 1e-6, "", True, impl)
    from opfuse.families.residual_norm import op as residual_norm

    fn = residual_norm.AddRMSNorm.custom_op.fn
    with torch.no_grad():
        single = host_cpu_us({"custom op (default)": lambda: torch.ops.opfuse.add_rmsnorm.default(*op_args),
                          "direct overload": lambda: torch.ops.opfuse.add_rmsnorm.direct(*op_args),
                          "the function": lambda: fn(*op_args)}, args.calls, args.rounds, sync)
    # The FP8 graph ops (opfuse/torch_compile/fp8_ops.py): the activation quantizer of an FP8 GEMM.
    from opfuse.torch_compile import fp8_ops

    q_args = (x, "e4m3", False, "", "reference" if args.device == "cpu" else "triton")
    with torch.no_grad():
        fp8_single = host_cpu_us({"custom op (default)": lambda: torch.ops.opfuse.compiled_quantize.default(*q_args),
                              "direct overload": lambda: torch.ops.opfuse.compiled_quantize.direct(*q_args),
                              "the function": lambda: fp8_ops.compiled_quantize._init_fn(*q_args)},
                             args.calls, args.rounds, sync)
    group = dist.group.WORLD
    xi, ri = torch.randn(4, 64, device=device, dtype=dtype), torch.randn(4, 64, device=device, dtype=dtype)
    xg, rg = xi.clone().requires_grad_(), ri.clone().requires_grad_()
    blocks, real = {}, direct_calls.use_direct_overloads
    for name, switch in (("direct", real), ("custom op", lambda graph: 0)):
        graph_pass.use_direct_overloads = switch
        torch.manual_seed(0)
        blocks[name] = opfuse.optimize(Block(64, group).to(device, dtype), options={"inductor": False})
        with torch.no_grad():
            blocks[name](xi, ri)
        blocks[name](xg, rg)[0].sum().backward()  # compiles the training graph now, not in the timed loop
    graph_pass.use_direct_overloads = real

    def infer(name):
        return lambda: blocks[name](xi, ri)

    def train(name):
        return lambda: blocks[name](xg, rg)[0].sum().backward()

    with torch.no_grad():
        inference = host_cpu_us({n: infer(n) for n in ("custom op", "direct")}, args.calls, args.rounds, sync)
    training = host_cpu_us({n: train(n) for n in ("custom op", "direct")}, max(1, args.calls // 4), args.rounds, sync)
    print(f"\nadd_rmsnorm called alone ({impl}, 4 x 64 {str(dtype).replace('torch.', '')}, {args.device}), "
          f"CPU us per call, best of {args.rounds} rounds of {args.calls}:")
    print("| call | us | over the function |")
    print("|---|---|---|")
    for name, us in single.items():
        print(f"| {name} | {us:.1f} | {us - single['the function']:+.1f} |")
    print(f"\ncompiled_quantize called alone ({q_args[-1]}, 4 x 64 {str(dtype).replace('torch.', '')} to e4m3), "
          f"CPU us per call:")
    print("| call | us | over the function |")
    print("|---|---|---|")
    for name, us in fp8_single.items():
        print(f"| {name} | {us:.1f} | {us - fp8_single['the function']:+.1f} |")
    print("\ncompiled block (2 fused ops, world 1, options={'inductor': False}), CPU us per call:")
    print("| graph calls | inference | forward + backward |")
    print("|---|---|---|")
    for name in ("custom op", "direct"):
        print(f"| {name} | {inference[name]:.1f} | {training[name]:.1f} |")
    saved = (inference["custom op"] - inference["direct"], training["custom op"] - training["direct"])
    print(f"| saved by direct | {saved[0]:+.1f} | {saved[1]:+.1f} |")
    programs = opfuse.programs(blocks["direct"])
    print("fusions: " + ", ".join(sorted({f"{f.rule}={f.impl}" for p in programs for f in p.fusions})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
