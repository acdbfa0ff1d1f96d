"""Merged projections without copies (``opfuse.optimize(model, merge_projections=True)``, the
default): q/k/v and gate/up are stored back to back, so the compiled graph runs one GEMM over
them reading a view of their storage (no ``cat``); the model's parameters, ``state_dict``,
optimizer steps and checkpoints behave as without merging; parameters moved after compiling are
packed again, and a graph never reads a layout it was not compiled for."""

import copy
import io
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opfuse
from opfuse.ops.packing import adjacent, pack_rows_
from opfuse.torch_compile import LayoutChanged

EAGER = {"inductor": False}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Attention(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, hidden) for _ in range(3))
        self.o_proj = nn.Linear(hidden, hidden)
        self.gate_proj, self.up_proj = nn.Linear(hidden, 64, bias=False), nn.Linear(hidden, 64, bias=False)
        self.down_proj = nn.Linear(64, hidden, bias=False)

    def forward(self, x):
        h = self.norm(x)
        h = x + self.o_proj(torch.tanh(self.q_proj(h)) * self.k_proj(h) + self.v_proj(h))
        return h + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def rules(programs):
    return sorted(f.rule for p in programs for f in p.fusions)


def test_one_gemm_per_group_and_the_model_behaves_as_unmerged(tmp_path):
    torch.manual_seed(0)
    model = Attention()
    plain = copy.deepcopy(model)
    params = list(model.parameters())
    with opfuse.config.override(dump_dir=str(tmp_path)):
        compiled = opfuse.optimize(model, options=EAGER)
        x = torch.randn(2, 5, 32)
        compiled(x).square().mean().backward()
    # Same parameter objects and state_dict (keys and values); the weights now share storage.
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert list(model.state_dict()) == list(plain.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key], value)
    assert adjacent([model.q_proj.weight, model.k_proj.weight, model.v_proj.weight, model.o_proj.weight])
    assert adjacent([model.q_proj.bias, model.k_proj.bias, model.v_proj.bias, model.o_proj.bias])
    assert adjacent([model.gate_proj.weight, model.up_proj.weight])
    # One GEMM for q/k/v, one for gate/up; they read a view of the packed weights.
    (program,) = opfuse.programs(compiled)
    assert rules([program]).count("horizontal_gemm") == 2
    (folder,) = os.listdir(tmp_path)
    after = (tmp_path / folder / "aten_after.py").read_text()
    assert after.count("opfuse.horizontal_linear") == 2 and "aten.cat" not in after and "as_strided" in after
    assert "merge_projections: weights stored back to back" in program.explain()
    # The same optimizer step as the unmerged model.
    plain(x).square().mean().backward()
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)
    for module in (model, plain):
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        optimizer.step()
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert adjacent([model.q_proj.weight, model.k_proj.weight, model.v_proj.weight])  # updated in place
    # Checkpoints: saved from the merged model, loaded by an unmerged one, and back.
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = Attention()
    fresh.load_state_dict(torch.load(buffer))
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)
    torch.manual_seed(3)
    other = Attention()
    model.load_state_dict(other.state_dict())
    assert adjacent([model.q_proj.weight, model.k_proj.weight, model.v_proj.weight])
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), other(x), atol=1e-5, rtol=1e-5)


def test_opting_out_leaves_the_weights_apart():
    model = Attention()
    compiled = opfuse.optimize(model, merge_projections=False, options=EAGER)
    with torch.no_grad():
        compiled(torch.randn(2, 32))
    (program,) = opfuse.programs(compiled)
    assert "horizontal_gemm" not in rules([program])
    assert "separate inputs of the compiled graph" in program.explain()
    assert not adjacent([model.q_proj.weight, model.k_proj.weight])


def test_parameters_moved_after_compiling_are_packed_again():
    torch.manual_seed(1)
    model = Attention()
    compiled = opfuse.optimize(model, options=EAGER)
    x = torch.randn(3, 32)
    with torch.no_grad():
        compiled(x)
        model.k_proj.weight.data = model.k_proj.weight.data.clone()  # as model.to(...) does
        model.k_proj.weight.mul_(2)
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    assert adjacent([model.q_proj.weight, model.k_proj.weight, model.v_proj.weight])


def test_a_graph_refuses_a_layout_it_was_not_compiled_for():
    """torch.compile(backend="opfuse") of a model whose weights the user packed: moving one of them
    afterwards is an error, not stale values."""
    torch.manual_seed(2)
    model = Attention()
    pack_rows_([model.q_proj.weight, model.k_proj.weight, model.v_proj.weight])
    pack_rows_([model.q_proj.bias, model.k_proj.bias, model.v_proj.bias])
    compiled = torch.compile(model, backend="opfuse", options=EAGER)
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
        model.v_proj.weight.data = model.v_proj.weight.data.clone()
        with pytest.raises(LayoutChanged, match="q_proj.weight, k_proj.weight, v_proj.weight were stored back to back"):
            compiled(x)


class GatedMLP(nn.Module):
    """A SwiGLU MLP: merged, gate | up is one GEMM whose packed output the fused gated activation reads."""

    def __init__(self, hidden=16, ffn=32):
        super().__init__()
        self.gate, self.up = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_a_merged_gate_up_feeds_the_fused_gated_activation(train):
    """The horizontal GEMM's packed output exists only in the op graph: lowering the gated activation
    after it must find its aten value (it raised LoweringError: no aten counterpart)."""
    torch.manual_seed(0)
    model = GatedMLP()
    want_model = copy.deepcopy(model)
    x = torch.randn(3, 5, 16, requires_grad=train)
    compiled = opfuse.optimize(model, options={"inductor": False})
    with torch.set_grad_enabled(train):
        got, want = compiled(x), want_model(x)
    torch.testing.assert_close(got, want)
    if train:
        (gx,) = torch.autograd.grad(got.sum(), x)
        (wx,) = torch.autograd.grad(want.sum(), x)
        torch.testing.assert_close(gx, wx)
    fused = [f.rule for p in opfuse.programs(compiled) for f in p.fusions]
    assert "horizontal_gemm" in fused, fused


def _lowered_gemms(model, x, train, monkeypatch, **optimize):
    """``(GEMMs, horizontal ops)`` of the graph opfuse lowered for ``model(x)``: ``aten.mm`` /
    ``aten.addmm`` nodes, and ``opfuse.horizontal_linear`` calls whose every output is read."""
    from opfuse.torch_compile import graph_pass

    lowered = []
    real = graph_pass.fuse_graph

    def capture(gm, settings=None):
        program = real(gm, settings)
        lowered.append(gm)
        return program

    monkeypatch.setattr(graph_pass, "fuse_graph", capture)
    compiled = opfuse.optimize(model, options=EAGER, **optimize)
    with torch.set_grad_enabled(train):
        out = compiled(x)
    if train:
        out.sum().backward()
    (gm,) = lowered
    gemms = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    merged = [n for n in gm.graph.nodes
              if getattr(n.target, "overloadpacket", None) is torch.ops.opfuse.horizontal_linear]
    for node in merged:  # the merged GEMM feeds the model: its outputs are read, not left for dead-code removal
        assert node.users and all(u.users for u in node.users), gm.graph
    return len(gemms), len(merged)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_merged_groups_replace_their_gemms_in_the_lowered_graph(train, monkeypatch):
    """The compile lowering rewires the users of q/k/v and gate/up to the merged GEMM's outputs, so
    their own GEMMs are gone (they stayed beside a merged GEMM nobody read, and the merge did
    nothing)."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32, requires_grad=train)
    gemms, merged = _lowered_gemms(Attention(), x, train, monkeypatch)
    torch._dynamo.reset()
    gemms_apart, merged_apart = _lowered_gemms(Attention(), x, train, monkeypatch, merge_projections=False)
    assert (merged, merged_apart) == (2, 0)
    assert gemms == gemms_apart - 5  # q, k, v, gate, up: two merged GEMMs instead


class HFRMSNorm(nn.Module):
    """Hugging Face's RMSNorm: pointwise ops, so its output keeps its input's layout."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class PerHeadNormAttention(nn.Module):
    """Qwen3 / OLMo-style projections: q and k normalised per head right after their GEMM
    (``view(..., heads, head_dim)``, then a norm whose decomposition flattens the leading dims);
    with ``transposed``, Gemma 3's order: the norm of ``[B, heads, S, head_dim]`` after
    ``transpose(1, 2)``, transposed back and viewed as ``[B, S, features]``."""

    def __init__(self, hidden=32, heads=4, kv_heads=2, head_dim=8, transposed=False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.transposed = heads, kv_heads, head_dim, transposed
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.q_norm, self.k_norm = HFRMSNorm(head_dim), HFRMSNorm(head_dim)

    def forward(self, x):
        if x.dim() == 2:
            x = x.unsqueeze(0)
        shape = x.shape[:-1]
        if self.transposed:
            q = self.q_norm(self.q_proj(x).view(*shape, -1, self.head_dim).transpose(1, 2))
            q = q.transpose(1, 2).view(*shape, -1)
        else:
            q = self.q_norm(self.q_proj(x).view(*shape, -1, self.head_dim)).view(-1, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(*shape, -1, self.head_dim))
        v = self.v_proj(x).view(*shape, self.kv_heads, self.head_dim).view(-1, self.kv_heads * self.head_dim)
        return q.sum() + (k.flatten(0, -2).float() ** 2).sum() + v.view(-1).square().sum()


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("tokens", [(2, 5), (7,)], ids=["batch-seq", "tokens"])
@pytest.mark.parametrize("transposed", [False, True], ids=["qwen3", "gemma3"])
def test_merged_outputs_that_the_model_views_as_if_contiguous(train, tokens, transposed):
    """q/k/v's users view them as the contiguous tensors their own GEMMs returned; the merged
    GEMM's outputs are column slices of one tensor, and the fused per-head norm returns a
    contiguous tensor where the unfused one kept its transposed input's layout: views the model
    takes further on cannot flatten those (Qwen3 and Gemma 3 raised "view size is not compatible
    with input tensor's size and stride")."""
    torch.manual_seed(0)
    model = PerHeadNormAttention(transposed=transposed)
    want_model = copy.deepcopy(model)
    x = torch.randn(*tokens, 32, requires_grad=train)
    compiled = opfuse.optimize(model, options=EAGER)
    with torch.set_grad_enabled(train):
        got, want = compiled(x), want_model(x)
    torch.testing.assert_close(got, want)
    if train:
        torch.testing.assert_close(torch.autograd.grad(got, x)[0], torch.autograd.grad(want, x)[0])
    assert "horizontal_gemm" in rules(opfuse.programs(compiled))


def _alias_in_own_storage(t: torch.Tensor) -> torch.Tensor:
    """A tensor at ``t``'s address with ``t``'s values but a storage of its own (what parameters
    moved out and back could get from the allocator: their old addresses, separate storages).
    The caller keeps ``t``'s storage alive."""
    import ctypes

    import numpy as np

    raw = (ctypes.c_byte * (t.numel() * t.element_size())).from_address(t.data_ptr())
    alias = torch.from_numpy(np.ctypeslib.as_array(raw)).view(t.dtype).view(t.shape)
    assert alias.data_ptr() == t.data_ptr() and alias.untyped_storage().data_ptr() == t.data_ptr()
    return alias


def test_the_per_call_repack_check_is_one_address_pass_and_sees_every_move(monkeypatch):
    """The optimized model checks its packed groups before every call: with nothing moved it only
    reads addresses (no adjacency check); a member re-pointed, resized or re-allocated at its old
    address in a storage of its own is packed again."""
    from opfuse.torch_compile import merge_projections

    torch.manual_seed(3)
    model = Attention()
    packed = merge_projections.merge_projections_(model)  # packs, then notes where each member is
    full_checks = []
    real_adjacent = merge_projections.adjacent
    monkeypatch.setattr(merge_projections, "adjacent", lambda ts: full_checks.append(1) or real_adjacent(ts))
    for _ in range(3):
        assert packed.ensure() == 0
    assert not full_checks  # nothing moved: addresses only
    qkv = [getattr(module, attr) for module, attr in packed.groups[0]]  # q, k, v and o
    assert len(qkv) == 4 and qkv[0] is model.q_proj.weight
    values = [w.detach().clone() for w in qkv]

    # The whole group re-allocated at the same addresses, each member in its own storage (a
    # member can only get its old address back once every member has left the shared buffer).
    old = [w.data for w in qkv]
    for w in qkv:
        w.data = _alias_in_own_storage(w.data)
    assert not adjacent(qkv)
    assert packed.ensure() == 1 and adjacent(qkv) and full_checks
    del old
    # Resized in place (same address): the group is checked again.
    full_checks.clear()
    model.gate_proj.weight.data = model.gate_proj.weight.data[:32]
    packed.ensure()
    assert full_checks
    for w, v in zip(qkv, values):
        assert torch.equal(w, v)


def test_a_graph_refuses_a_member_reallocated_at_its_old_address():
    """The compiled graph's own layout check (cheap while nothing moves) also sees a member at its
    old address in a storage of its own."""
    torch.manual_seed(4)
    model = Attention()
    pack_rows_([model.q_proj.weight, model.k_proj.weight, model.v_proj.weight])
    compiled = torch.compile(model, backend="opfuse", options=EAGER)
    x = torch.randn(3, 32)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
        qkv = [model.q_proj.weight, model.k_proj.weight, model.v_proj.weight]
        old = [w.data for w in qkv]
        for w in qkv:
            w.data = _alias_in_own_storage(w.data)
        with pytest.raises(LayoutChanged, match="were stored back to back"):
            compiled(x)
        for w, data in zip(qkv, old):  # back in the shared storage: runs again
            w.data = data
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
