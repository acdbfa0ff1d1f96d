"""A Llama-style decoder in plain PyTorch, tensor-parallel two ways, compiled with opfuse's
torch.compile backend.

The model is written as people write it (no opfuse ops): attention through
``F.scaled_dot_product_attention`` with rotary embeddings and grouped key/value heads, a SwiGLU MLP,
and a hand-written float32 RMSNorm (``x.float()``, ``pow(2).mean(-1)``, ``rsqrt``, ``* weight``).
Tensor parallelism either

* ``--tp dist``: Megatron / gpt-fast style, each rank builds its shard of every projection and
  calls ``torch.distributed.all_reduce`` after the row-parallel ones (inside autograd functions
  with the usual conjugate backward), or
* ``--tp dtensor``: the unsharded model handed to ``parallelize_module`` with ``ColwiseParallel``
  / ``RowwiseParallel`` (the plan Hugging Face's ``tp_plan`` uses), or
* ``--tp dtensor-sp``: the same with ``SequenceParallel`` norms (torchtitan's plan): the residual
  stream is sharded along the sequence, all-gathers feed the column projections and the row
  projections reduce-scatter.

``opfuse.optimize(model)`` compiles it; every all-reduce after a row-parallel projection fuses
with the residual add and the RMSNorm that follows it, the next layer's included (with sequence
parallelism, each row projection fuses with its reduce-scatter and the add with the norm)::

    python examples/llama_tp.py --tp dist             # 2 gloo processes on CPU (NCCL with 2+ GPUs)
    python examples/llama_tp.py --tp dtensor --train  # forward + backward, gradients checked
    python examples/llama_tp.py --explain             # what fused, what did not and why

Outputs (and gradients with ``--train``) are checked against the same sharded model run eagerly.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class Config:
    vocab: int = 96
    dim: int = 32
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 64
    eps: float = 1e-5
    max_seq: int = 64
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


# The model ------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Llama's norm as the checkpoints' code writes it: float32 statistics, weight applied after the
    cast back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate(x, cos, sin):
    """Rotary embedding of ``x [batch, seq, heads, head_dim]`` (the rotate-half form)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce in forward (after a row-parallel projection), identity in backward."""

    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _CopyToTP(torch.autograd.Function):
    """Identity in forward (before column-parallel projections), all-reduce of the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class KVCache(nn.Module):
    """gpt-fast's static key/value cache: ``[batch, kv heads, max_seq, head_dim]`` buffers written
    in place at ``input_pos`` (static shapes: one compiled graph, CUDA-graph friendly)."""

    def __init__(self, batch: int, kv_heads: int, max_seq: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch, kv_heads, max_seq, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos, k, v):
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, cfg: Config, shards: int = 1):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.kv_groups = cfg.heads // cfg.kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim // shards, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim // shards, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim // shards, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim // shards, cfg.dim, bias=False)
        self.tp = shards > 1  # sharded by hand: all-reduce explicitly (DTensor does it by itself)
        self.kv_cache = None  # KVCache after Llama.setup_caches (decode)

    def forward(self, x, cos, sin, input_pos=None, mask=None):
        batch, seq, _ = x.shape
        if self.tp:
            x = _CopyToTP.apply(x)
        # -1 heads: this rank's heads, whichever way the projections were sharded.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.kv_cache is not None:  # decode: append to the static cache, attend over all of it
            k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(self.kv_groups, dim=1)
        v = v.repeat_interleave(self.kv_groups, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
        return _ReduceFromTP.apply(out) if self.tp else out


class MLP(nn.Module):
    def __init__(self, cfg: Config, shards: int = 1):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn // shards, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn // shards, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn // shards, cfg.dim, bias=False)  # down
        self.tp = shards > 1

    def forward(self, x):
        if self.tp:
            x = _CopyToTP.apply(x)
        out = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return _ReduceFromTP.apply(out) if self.tp else out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config, shards: int = 1):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attention = Attention(cfg, shards)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.feed_forward = MLP(cfg, shards)

    def forward(self, x, cos, sin, input_pos=None, mask=None):
        h = x + self.attention(self.attention_norm(x), cos, sin, input_pos, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: Config, shards: int = 1):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, shards) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.max_seq).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)

    def setup_caches(self, batch: int, max_seq: int | None = None) -> None:
        """Static key/value caches for decoding ``batch`` sequences (gpt-fast's layout); after this,
        call ``model(tokens, input_pos)`` with the positions ``tokens [batch, seq]`` take."""
        max_seq = max_seq or self.cfg.max_seq
        weight = self.output.weight
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        for layer in self.layers:
            attention = layer.attention
            kv_heads = attention.wk.weight.shape[0] // attention.head_dim
            if hasattr(attention.wk.weight, "to_local"):
                kv_heads = attention.wk.weight.to_local().shape[0] // attention.head_dim
            attention.kv_cache = KVCache(batch, kv_heads, max_seq, attention.head_dim, local.dtype, local.device)
        causal = torch.ones(max_seq, max_seq, dtype=torch.bool, device=local.device).tril()
        self.register_buffer("causal_mask", causal, persistent=False)

    def forward(self, tokens, input_pos=None):
        seq = tokens.shape[1]
        dtype = self.output.weight.dtype
        if input_pos is None:
            cos, sin, mask = self.cos[:, :seq].to(dtype), self.sin[:, :seq].to(dtype), None
        else:  # decode with the caches: rotary angles and causal mask at the written positions
            cos, sin = self.cos[:, input_pos].to(dtype), self.sin[:, input_pos].to(dtype)
            mask = self.causal_mask[None, None, input_pos]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, input_pos, mask)
        return self.output(self.norm(h))


# Tensor parallelism -----------------------------------------------------------------------------------

TP_MODES = ("dist", "dtensor", "dtensor-sp")
#: Row-parallel projections: each is followed by an all-reduce that fuses with the next add + norm.
ROW_PARALLEL = ("attention.wo", "feed_forward.w2")
COLUMN_PARALLEL = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")


def _built_on(device, dtype, cfg: Config, shards: int = 1) -> Llama:
    """A Llama initialised on ``device`` (at hidden 8192 a GPU does it in milliseconds, the CPU's one
    random stream in ~30 s), in ``dtype``."""
    with torch.device(device):
        return Llama(cfg, shards=shards).to(dtype=dtype)


def shard_by_hand(full: Llama, rank: int, world: int) -> Llama:
    """``full``'s shard for ``rank``: the Megatron layout, collectives written in the model."""
    model = _built_on(full.output.weight.device, full.output.weight.dtype, full.cfg, shards=world)
    state = {}
    for name, tensor in full.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if any(module.endswith(c) for c in COLUMN_PARALLEL):
            tensor = tensor.chunk(world, dim=0)[rank]
        elif any(module.endswith(r) for r in ROW_PARALLEL):
            tensor = tensor.chunk(world, dim=1)[rank]
        state[name] = tensor.clone()
    model.load_state_dict(state)
    return model


def shard_with_dtensor(full: Llama, world: int, sequence_parallel: bool = False) -> Llama:
    """A copy of ``full`` parallelised by ``parallelize_module``: ColwiseParallel / RowwiseParallel,
    and with ``sequence_parallel`` torchtitan's plan (norms and residual stream sharded along the
    sequence: all-gathers before the column projections, reduce-scatters after the row ones)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    model = _built_on(full.output.weight.device, full.output.weight.dtype, full.cfg)
    model.load_state_dict(full.state_dict())
    mesh = init_device_mesh(full.output.weight.device.type, (world,))
    row = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    plan = {}
    for i in range(full.cfg.layers):
        plan.update({f"layers.{i}.{name}": ColwiseParallel() for name in COLUMN_PARALLEL})
        plan.update({f"layers.{i}.{name}": row for name in ROW_PARALLEL})
        if sequence_parallel:
            plan.update({
                f"layers.{i}.attention_norm": SequenceParallel(),
                f"layers.{i}.ffn_norm": SequenceParallel(),
                # x, cos, sin, input_pos, mask: only x is a sharded activation
                f"layers.{i}.attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                                            desired_input_layouts=(Replicate(), None, None, None,
                                                                                   None)),
                f"layers.{i}.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                               desired_input_layouts=(Replicate(),)),
            })
    if sequence_parallel:
        plan.update({
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
    return parallelize_module(model, mesh, plan)


def vary_norm_weights(model: nn.Module) -> nn.Module:
    """Norm weights away from 1 (as in a trained model), from the global RNG: a norm applied with
    the wrong weight, or not at all, shows in the outputs."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
    return model


def unsharded(cfg: Config, dtype=torch.float32, device="cpu", seed: int = 0) -> Llama:
    """The unsharded model, the same on every rank (same seed; initialised on ``device``, so a GPU's
    model and a CPU's differ)."""
    torch.manual_seed(seed)
    return vary_norm_weights(_built_on(device, dtype, cfg))


def build(tp: str, rank: int, world: int, cfg: Config, dtype=torch.float32, device="cpu", seed: int = 0,
          full: Llama | None = None) -> Llama:
    """The unsharded model (``full``, else :func:`unsharded`), sharded the ``tp`` way."""
    full = full if full is not None else unsharded(cfg, dtype, device, seed)
    if tp == "dist":
        return shard_by_hand(full, rank, world)
    if tp in ("dtensor", "dtensor-sp"):
        return shard_with_dtensor(full, world, sequence_parallel=tp == "dtensor-sp")
    raise ValueError(f"tp={tp!r}; accepted: {', '.join(TP_MODES)}")


# The check ---------------------------------------------------------------------------------------------


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` (float32 arithmetic)."""
    got, want = got.float(), want.float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def local_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, as this rank holds it (local shards of DTensors)."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name] = grad.to_local() if hasattr(grad, "to_local") else grad
    return grads


def run_check(rank: int, world: int, tp: str = "dist", train: bool = False, inductor: bool = True,
              cfg: Config | None = None, dtype=torch.float32, batch: int = 2, seq: int = 8, verbose: bool = True,
              **compile_kwargs):
    """Compile the ``tp`` model with opfuse, run it next to the same model eagerly; returns
    ``(errors, programs)`` with ``errors = {"output": relative error, "grad <name>": ...}``
    (:func:`relative_error`). ``compile_kwargs`` go to ``opfuse.optimize`` (e.g. ``mode=``)."""
    import opfuse

    cfg = cfg or Config()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    eager = build(tp, rank, world, cfg, dtype, device)
    compiled_model = build(tp, rank, world, cfg, dtype, device)
    if not inductor:
        compile_kwargs["options"] = {"inductor": False}
    compiled = opfuse.optimize(compiled_model, **compile_kwargs)
    tokens = torch.randint(0, cfg.vocab, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    errors = {}
    with torch.set_grad_enabled(train):
        want = eager(tokens)
        # Inference runs a few times: under mode="reduce-overhead" the third call replays a CUDA graph.
        for _ in range(1 if train else 3):
            got = compiled(tokens)
    errors["output"] = relative_error(got, want)
    if train:
        grad_out = torch.randn(want.shape, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dtype)
        want.backward(grad_out)
        got.backward(grad_out)
        ref, mine = local_grads(eager), local_grads(compiled_model)
        for name in ref:
            errors[f"grad {name}"] = relative_error(mine[name], ref[name])
    programs = opfuse.programs(compiled)
    if verbose and rank == 0:
        for program in programs:
            print(program.explain())
        worst = max(errors, key=errors.get)
        print(f"compiled vs eager, max |difference| / max |eager|: output {errors['output']:.2e}" + (
            f", gradients {errors[worst]:.2e} ({worst})" if train else ""))
    return errors, programs


def _worker(rank, world, tp, train, inductor, batch):
    errors, _ = run_check(rank, world, tp, train, inductor, batch=batch)
    tolerance = 1e-5  # float32; the fused ops round differently from Inductor's kernels
    bad = {k: v for k, v in errors.items() if not v <= tolerance}
    if bad:
        raise AssertionError(f"compiled model differs from eager beyond {tolerance}: {bad}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", choices=TP_MODES, default="dist",
                        help="dtensor-sp: DTensor with sequence parallelism (torchtitan's plan)")
    parser.add_argument("--train", action="store_true", help="forward + backward; check gradients too")
    parser.add_argument("--world", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1,
                        help="sequences per step (dtensor-sp: the sequence-sharded GEMM fusions need batch 1, "
                             "where sequence-major is token-major)")
    parser.add_argument("--no-inductor", action="store_true",
                        help="run the fused graphs eagerly (options={'inductor': False}): compiles in seconds")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from opfuse.cli.launch import default_backend, run

    backend, gpus = default_backend()
    world = args.world or (gpus if backend == "nccl" else 2)
    run(_worker, world, args.tp, args.train, not args.no_inductor, args.batch, backend=backend)
    print("result: check PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
