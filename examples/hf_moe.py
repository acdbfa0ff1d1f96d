"""Mixture-of-experts blocks written as Hugging Face writes them, compiled with opfuse.

transformers' Mixtral and Qwen2-MoE blocks, reduced to what they compute (the router, the
per-expert loop over ``torch.where`` of the expert mask with ``index_add_``, Qwen2-MoE's gated
shared expert), in a small decoder. ``opfuse.optimize`` rewrites each block into two grouped GEMMs
with the group sizes on the device (no graph break, no host sync) and fuses the rest as for any
model; with ``--fp8`` the grouped GEMMs and projections run in FP8::

    python examples/hf_moe.py                      # Mixtral-style, CPU, checked against eager
    python examples/hf_moe.py --block qwen2 --fp8  # Qwen2-MoE-style, FP8 (emulated on CPU)

The tests (tests/unit/test_compile_moe.py, tests/dist/test_compile_fp8_moe.py) and bench/moe.py
use these classes; transformers itself is not needed.
"""

import torch
import torch.nn.functional as F
from torch import nn


class MixtralBlockSparseTop2MLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states):
        current_hidden_states = self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states)
        return self.w2(current_hidden_states)


class MixtralSparseMoeBlock(nn.Module):
    """transformers' ``MixtralSparseMoeBlock`` (its ``expert_hit`` loop)."""

    def __init__(self, hidden=32, ffn=48, num_experts=8, top_k=2):
        super().__init__()
        self.hidden_dim, self.ffn_dim = hidden, ffn
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList([MixtralBlockSparseTop2MLP(hidden, ffn) for _ in range(num_experts)])
        self.jitter_noise = 0.0

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros((batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype,
                                          device=hidden_states.device)
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class Qwen2MoeMLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Qwen2MoeSparseMoeBlock(nn.Module):
    """transformers' ``Qwen2MoeSparseMoeBlock`` (loop over every expert, gated shared expert)."""

    def __init__(self, hidden=32, ffn=24, num_experts=8, top_k=2, shared_ffn=40, norm_topk_prob=False):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList([Qwen2MoeMLP(hidden, ffn) for _ in range(num_experts)])
        self.shared_expert = Qwen2MoeMLP(hidden, shared_ffn)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros((batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype,
                                          device=hidden_states.device)
        expert_mask = torch.nn.functional.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        shared_expert_output = self.shared_expert(hidden_states)
        shared_expert_output = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared_expert_output
        final_hidden_states = final_hidden_states + shared_expert_output
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class RMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class MoEDecoder(nn.Module):
    """``layers`` pre-norm MoE layers (``h = h + moe(norm(h))``) and a final norm; with ``tp`` (a
    process group), each expert's gate/up are column shards and its down a row shard of the full
    expert (as ``tp_plan`` shards them) and the block's output is all-reduced after the combine and
    the reshape, before the residual add, as Hugging Face's ``gather`` output hook does."""

    def __init__(self, block=MixtralSparseMoeBlock, layers=2, hidden=32, tp=None, **kwargs):
        super().__init__()
        self.tp = tp
        self.norms = nn.ModuleList(RMSNorm(hidden) for _ in range(layers))
        self.blocks = nn.ModuleList(block(hidden=hidden, **kwargs) for _ in range(layers))
        self.norm = RMSNorm(hidden)

    def forward(self, h):
        for norm, block in zip(self.norms, self.blocks):
            out, _logits = block(norm(h))
            if self.tp is not None:
                out = all_reduce(out, self.tp)
            h = h + out
        return self.norm(h)


def all_reduce(x, group):
    """A sum over ``group`` after a row-parallel projection: all-reduce in forward, identity in
    backward (written as examples/llama_tp.py writes it)."""
    return _ReduceFromTP.apply(x, group)


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def shard_experts_(model: nn.Module, rank: int, world: int) -> nn.Module:
    """Replace each expert's projections by this rank's tensor-parallel shards (gate/up: rows
    ``r``; down: columns ``r``), in place."""
    for module in model.modules():
        names = [n for n in ("w1", "w3", "gate_proj", "up_proj") if isinstance(getattr(module, n, None), nn.Linear)]
        down = next((n for n in ("w2", "down_proj") if isinstance(getattr(module, n, None), nn.Linear)), None)
        if not names or down is None:
            continue
        with torch.no_grad():
            for name in names:
                layer = getattr(module, name)
                layer.weight = nn.Parameter(layer.weight.chunk(world, 0)[rank].clone())
            layer = getattr(module, down)
            layer.weight = nn.Parameter(layer.weight.chunk(world, 1)[rank].clone())
    return model


def main(argv=None) -> int:
    import argparse
    import copy

    import torch.distributed as dist

    import opfuse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block", choices=["mixtral", "qwen2"], default="mixtral")
    parser.add_argument("--fp8", action="store_true", help="TensorScaling FP8 (emulated in float32 on CPU)")
    args = parser.parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = MoEDecoder(MixtralSparseMoeBlock if args.block == "mixtral" else Qwen2MoeSparseMoeBlock)
    eager = copy.deepcopy(model)
    compiled = opfuse.optimize(model, fp8=opfuse.fp8.TensorScaling() if args.fp8 else None,
                               options={"inductor": False})
    x = torch.randn(2, 16, 32, requires_grad=True)
    y, want = compiled(x), eager(x)
    y.sum().backward()
    for program in opfuse.programs(compiled):
        print(program.explain())
    error = ((y - want).abs().max() / want.abs().max()).item()
    print(f"compiled vs Hugging Face's loop run eagerly, max |difference| / max |eager|: {error:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
