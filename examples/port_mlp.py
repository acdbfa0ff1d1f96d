"""Porting a plain-PyTorch gated MLP block to opfuse, run with torchrun.

    torchrun --nproc-per-node 2 examples/port_mlp.py            # 2 CPU processes (gloo)
    torchrun --nproc-per-node 4 examples/port_mlp.py            # 4 GPUs (NCCL) when the host has them

What it shows, step by step (docs/guide.md, "Porting a model"):

1. the existing block (``PlainMLP``: RMSNorm -> silu(gate_proj) * up_proj -> down_proj -> + residual
   -> RMSNorm, nn.Linear / nn.RMSNorm, as Hugging Face's LlamaMLP) and the same block as
   ``ops.Sequential`` with tensor-parallel layers (``GatedLinear`` holds gate and up);
2. loading the plain model's weights into the sharded block (every rank takes its shard of each)
   with ``opfuse.load_unsharded_state_dict``;
3. forward, backward and an optimizer step on both, compared;
4. going back: ``opfuse.unsharded_state_dict`` gathers the full trained weights, which load into
   the plain model.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import opfuse
from opfuse import ops

HIDDEN, FFN, TOKENS, EPS = 64, 128, 16, 1e-6


class PlainMLP(nn.Module):
    """The block as an existing model writes it (one process, no parallelism)."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.RMSNorm(HIDDEN, eps=EPS)
        self.gate_proj = nn.Linear(HIDDEN, FFN)
        self.up_proj = nn.Linear(HIDDEN, FFN)
        self.down_proj = nn.Linear(FFN, HIDDEN)
        self.norm2 = nn.RMSNorm(HIDDEN, eps=EPS)

    def forward(self, x, residual):
        h = self.norm1(x)
        h = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)) + residual
        return self.norm2(h), h


def opfuse_mlp(device):
    """The same block for opfuse: gate and up column-parallel, down row-parallel over the default group."""
    return ops.Sequential(
        ops.RMSNorm(HIDDEN, eps=EPS, device=device),
        ops.GatedLinear(HIDDEN, FFN, bias=True, parallel="column", device=device),  # silu(gate) * up
        ops.Linear(FFN, HIDDEN, parallel="row", device=device),
        ops.AddExtraInput(),      # + residual, the block's second input
        ops.MakeExtraOutput(),    # the new residual is returned too
        ops.RMSNorm(HIDDEN, eps=EPS, device=device),
    )


# state_dict names: plain model -> ops.Sequential (its ops are numbered)
NAMES = {"norm1.weight": "0.weight", "gate_proj.weight": "1.gate_weight", "gate_proj.bias": "1.gate_bias",
         "up_proj.weight": "1.up_weight", "up_proj.bias": "1.up_bias", "down_proj.weight": "2.weight",
         "down_proj.bias": "2.bias", "norm2.weight": "5.weight"}


def main() -> None:
    # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if use_gpus:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same plain model and inputs on every rank
    plain = PlainMLP().to(device)
    block = opfuse_mlp(device)
    opfuse.load_unsharded_state_dict(block, {NAMES[k]: v for k, v in plain.state_dict().items()})

    x = torch.randn(TOKENS, HIDDEN, device=device)
    residual = torch.randn(TOKENS, HIDDEN, device=device)
    grads = [torch.randn(TOKENS, HIDDEN, device=device) for _ in range(2)]
    steps = {}
    for name, model in (("plain", plain), ("opfuse", block)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        y, h = model(x, residual)
        torch.autograd.backward((y, h), grads)
        optimizer.step()
        steps[name] = (y.detach(), h.detach())
    forward_error = max((a - b).abs().max().item() for a, b in zip(steps["plain"], steps["opfuse"]))

    full = opfuse.unsharded_state_dict(block)                     # collective: every rank calls it
    back = {plain_name: full[ours] for plain_name, ours in NAMES.items()}
    weight_error = max((back[k] - v).abs().max().item() for k, v in plain.state_dict().items())
    restored = PlainMLP().to(device)
    restored.load_state_dict(back)                                # an ordinary checkpoint again
    if rank == 0:
        fused = ", ".join(f"{f.rule}={f.impl}" for f in opfuse.compile(block, x, residual).fusions)
        print(f"port_mlp: world={dist.get_world_size()} ({device.type}); fusions: {fused}")
        print(f"  outputs vs the plain model:              max abs diff {forward_error:.2e}")
        print(f"  weights after one SGD step, gathered:    max abs diff {weight_error:.2e}")
        ok = forward_error < 1e-4 and weight_error < 1e-5
        print("port_mlp: " + ("PASSED" if ok else "FAILED"))
        if not ok:
            raise SystemExit(1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
