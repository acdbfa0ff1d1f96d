"""The torch.compile backend on 2 gloo ranks on the graph shapes of Hugging Face models as
transformers shards them (issue 29.6), written in plain PyTorch (transformers is not needed):

* the embedding sharded by vocabulary (``tp_plan="auto"``): each rank looks up its rows, the
  result is all-reduced, so layer 0's first residual add adds two all-reduced values;
* Qwen2's biased q/k/v projections, the key/value ones one head (head_dim features) per rank,
  viewed as ``[B, S, 1, head_dim]``;
* per-block graphs (FSDP2 + TP: dynamo compiles one graph per block), each ending with its MLP's
  all-reduce and residual add;
* three sequence lengths (automatic dynamic shapes).

Every case runs next to the same sharded model eagerly (outputs and gradients); one spawn runs
them all (process start-up and compilation dominate on 2 CPU cores).
"""

import dataclasses

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from ..transformers_support import tp_auto
from .harness import run

F32 = dict(atol=2e-5, rtol=2e-5)


@dataclasses.dataclass
class Config:
    vocab: int = 64
    dim: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    ffn: int = 64
    layers: int = 2


class Norm(nn.Module):
    """Hugging Face's RMSNorm."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x.to(dtype)


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient (the input of column-parallel projections)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_reduce(grad, "sum", dist.group.WORLD)


def reduce(x):
    return funcol.all_reduce(x, "sum", dist.group.WORLD)


class VocabEmbedding(nn.Module):
    """This rank's rows of the embedding; tokens of other ranks' rows look up zeros."""

    def __init__(self, cfg, rank, world):
        super().__init__()
        rows = cfg.vocab // world
        self.start, self.end = rank * rows, (rank + 1) * rows
        self.weight = nn.Parameter(torch.randn(rows, cfg.dim))

    def forward(self, tokens):
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        return reduce(F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0))


class Attention(nn.Module):
    def __init__(self, cfg, world):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim // world, bias=True)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim // world, bias=True)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim // world, bias=True)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim // world, cfg.dim, bias=False)
        self.groups = cfg.heads // cfg.kv_heads

    def forward(self, x):
        b, s, _ = x.shape
        x = _CopyToTP.apply(x)
        shape = (b, s, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2).repeat_interleave(self.groups, dim=1)
        v = self.v_proj(x).view(shape).transpose(1, 2).repeat_interleave(self.groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return reduce(self.o_proj(out.transpose(1, 2).reshape(b, s, -1)))


class MLP(nn.Module):
    def __init__(self, cfg, world):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn // world, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn // world, bias=False)
        self.down_proj = nn.Linear(cfg.ffn // world, cfg.dim, bias=False)

    def forward(self, x):
        x = _CopyToTP.apply(x)
        return reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, world):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = Norm(cfg.dim), Norm(cfg.dim)
        self.self_attn, self.mlp = Attention(cfg, world), MLP(cfg, world)

    def forward(self, hidden):  # as transformers writes it
        residual = hidden
        hidden = self.self_attn(self.input_layernorm(hidden))
        hidden = residual + hidden
        residual = hidden
        hidden = self.mlp(self.post_attention_layernorm(hidden))
        return residual + hidden


class Model(nn.Module):
    def __init__(self, cfg, rank, world):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg, rank, world)
        self.layers = nn.ModuleList(DecoderLayer(cfg, world) for _ in range(cfg.layers))
        self.norm = Norm(cfg.dim)

    def forward(self, tokens):
        hidden = self.embed_tokens(tokens)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.norm(hidden)


def build(rank, world, cfg):
    """This rank's shard of one full model (the same seed on every rank)."""
    torch.manual_seed(0)
    full = Model(cfg, 0, 1)
    with torch.no_grad():
        for name, param in full.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
    model = Model(cfg, rank, world)
    state = {}
    for name, tensor in full.state_dict().items():
        if name == "embed_tokens.weight":
            tensor = tensor.chunk(world, dim=0)[rank]
        elif any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            tensor = tensor.chunk(world, dim=0)[rank]
        elif any(p in name for p in ("o_proj", "down_proj")):
            tensor = tensor.chunk(world, dim=1)[rank]
        state[name] = tensor.clone()
    model.load_state_dict(state)
    return model


def forward_rules(programs):
    return [f.rule for p in programs for f in p.fusions_in("forward")]


def optimize_blocks(model):
    """Each decoder layer compiled on its own, as FSDP2 + TP gets it (torchtitan compiles each block;
    FSDP2's hooks between them break the graph anyway): the embedding and the final norm stay eager."""
    import opfuse

    blocks = [opfuse.optimize(layer, options={"inductor": False}) for layer in model.layers]
    for i, block in enumerate(blocks):
        model.layers[i] = block
    return model, lambda: [p for block in blocks for p in opfuse.programs(block)]


def check_against_eager(rank, world, cfg, seqs=(6,), compile_fn=None):
    """Run ``compile_fn(model) -> (compiled, programs)`` next to the eager model; returns the
    programs compiled."""
    import opfuse

    eager, mine = build(rank, world, cfg), build(rank, world, cfg)
    if compile_fn is None:
        compiled = opfuse.optimize(mine, options={"inductor": False})
        compiled, programs = compiled, lambda: opfuse.programs(compiled)
    else:
        compiled, programs = compile_fn(mine)
    try:  # the "opfuse" name's backend is shared: count what it compiled before this model
        before = len(programs())
    except RuntimeError as error:
        assert "nothing compiled yet" in str(error)
        before = 0
    for seq in seqs:
        tokens = torch.randint(0, cfg.vocab, (2, seq), generator=torch.Generator().manual_seed(seq))
        want, got = eager(tokens), compiled(tokens)
        torch.testing.assert_close(got, want, **F32)
        grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
        want.backward(grad)
        got.backward(grad)
        for (name, a), b in zip(mine.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, **F32, msg=lambda m: f"rank {rank} grad {name}: {m}")
            a.grad = b.grad = None
    return programs()[before:]


def cases(rank, world):
    cfg = Config()
    assert cfg.kv_heads * cfg.head_dim // world == cfg.head_dim  # one key/value head per rank

    # One graph: the embedding's all-reduce fuses with layer 0's input norm, every row-parallel
    # all-reduce (layer 0's o_proj included) with its residual add and the next norm.
    (program,) = check_against_eager(rank, world, cfg)
    text = program.explain()
    assert forward_rules([program]).count("allreduce_add_rmsnorm") == 2 * cfg.layers + 1, text
    adds = [f for f in program.fusions_in("forward") if "AddExtraInput" in f.ops and "AllReduce" in f.ops]
    assert len(adds) == 2 * cfg.layers, text
    gm = program.unfused_graph_module
    kinds = [gm.get_submodule(n.target).kind for n in gm.graph.nodes if n.op == "call_module"]
    assert kinds.count("BasicLinear") == 7 * cfg.layers, kinds  # k_proj and v_proj too
    assert "_quantize" not in text, text

    # A graph per block: each ends with the MLP's all-reduce and the residual add, fused alone
    # (no norm follows in the graph); the attention's all-reduce still takes the add and the norm.
    programs = check_against_eager(rank, world, cfg, compile_fn=optimize_blocks)
    assert len(programs) == cfg.layers, programs
    for block in programs:
        ends = [f for f in block.fusions_in("forward") if f.rule == "allreduce" and "AddExtraInput" in f.ops]
        assert len(ends) == 1, block.explain()
        assert forward_rules([block]).count("allreduce_add_rmsnorm") == 1, block.explain()

    # Three sequence lengths: one static graph, one with a symbolic sequence dim; both fused.
    def dynamic(model):
        import opfuse

        compiled = torch.compile(model, backend="opfuse", options={"inductor": False})
        return compiled, lambda: opfuse.programs(compiled)

    torch._dynamo.reset()  # forget the lengths the cases above compiled (automatic dynamic is per code object)
    programs = check_against_eager(rank, world, cfg, seqs=(5, 7, 9), compile_fn=dynamic)
    assert len(programs) == 2, programs
    for program in programs:
        assert forward_rules([program]).count("allreduce_add_rmsnorm") == 2 * cfg.layers + 1, program.explain()


def test_hugging_face_shapes_fuse_and_match_eager():
    run(cases, 2, timeout=900)


# transformers itself (optional: CI does not install it) -----------------------------------------------


def transformers_case(rank, world, path, layers):
    import os

    import opfuse
    from transformers import AutoModelForCausalLM

    for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", rank)):
        os.environ.setdefault(name, str(value))

    def load():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **tp_auto())
        model.config._attn_implementation = "sdpa"
        return model

    eager, mine = load(), load()
    compiled = opfuse.optimize(mine, options={"inductor": False})
    tokens = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = eager(tokens, use_cache=False).logits
        got = compiled(tokens, use_cache=False).logits
    torch.testing.assert_close(got, want, **F32)
    programs = opfuse.programs(compiled)
    text = "\n".join(p.explain() for p in programs)
    # Every o_proj and down_proj all-reduce with its add and norm (layer 0's o_proj next to the
    # vocabulary-sharded embedding's all-reduce included), and the embedding's with the first norm.
    assert forward_rules(programs).count("allreduce_add_rmsnorm") == 2 * layers + 1, text
    assert "_quantize" not in text, text


def test_transformers_qwen2_with_tp_plan_auto(tmp_path):
    """Qwen2 (biased q/k/v, one key/value head per rank) loaded with ``tp_plan="auto"``: the
    embedding sharded by vocabulary, every projection as transformers shards it."""
    import pytest

    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it for tp_plan
    from transformers import AutoModelForCausalLM, Qwen2Config

    layers = 2
    config = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
    model.save_pretrained(tmp_path)
    run(transformers_case, 2, str(tmp_path), layers, timeout=900)
