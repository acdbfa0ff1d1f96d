"""Decode attention over repeated key/value heads reads the cache unrepeated
(``opfuse/torch_compile/grouped_attention.py``): outputs equal eager's, the repeats leave the graph,
and attentions that cannot be folded are left with their reason in ``explain()``."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opfuse

EAGER = {"inductor": False}
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def repeat_heads(t, groups, style):
    if style == "gpt-fast":
        return t.repeat_interleave(groups, dim=1)
    batch, heads, length, dim = t.shape  # Hugging Face's repeat_kv
    return t[:, :, None].expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)


class CachedAttention(nn.Module):
    """Attention of ``q [batch, positions, heads, dim]`` over a static key/value cache with fewer heads."""

    def __init__(self, batch=4, kv_heads=4, groups=4, length=24, dim=16, style="gpt-fast", causal=False):
        super().__init__()
        self.groups, self.style, self.causal = groups, style, causal
        self.register_buffer("k", torch.randn(batch, kv_heads, length, dim))
        self.register_buffer("v", torch.randn(batch, kv_heads, length, dim))

    def forward(self, q, mask=None):
        batch, positions = q.shape[:2]
        k, v = repeat_heads(self.k, self.groups, self.style), repeat_heads(self.v, self.groups, self.style)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, is_causal=self.causal)
        return out.transpose(1, 2).reshape(batch, positions, -1)


def notes(compiled) -> list[str]:
    return [text for program in opfuse.programs(compiled) for _, text in program.notes]


@pytest.mark.parametrize("style", ["gpt-fast", "hf"])
@pytest.mark.parametrize("mask", ["bool", "float", "none", "broadcast"])
def test_decode_attention_reads_the_cache_unrepeated(style, mask):
    torch.manual_seed(0)
    model = CachedAttention(style=style)
    q = torch.randn(4, 1, 16, 16)
    masks = {"bool": torch.rand(4, 1, 1, 24) > 0.3, "float": torch.randn(1, 1, 1, 24), "none": None,
             "broadcast": torch.randn(1, 1, 1, 24).expand(4, 16, 1, 24)}
    compiled = opfuse.optimize(model, options=EAGER)
    with torch.no_grad():
        got, want = compiled(q, masks[mask]), model(q, masks[mask])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert any("query groups folded into query positions, the cache read unrepeated" in n for n in notes(compiled))


def test_the_repeats_leave_the_graph_and_inductor_compiles_it():
    from opfuse.torch_compile.grouped_attention import fold_grouped_queries

    captured = []

    def backend(gm, inputs):
        from torch._functorch.aot_autograd import aot_module_simplified

        def forward(graph_module, _):
            before = sum(n.target == torch.ops.aten.expand.default for n in graph_module.graph.nodes)
            folded, left = fold_grouped_queries(graph_module)
            after = sum(n.target == torch.ops.aten.expand.default for n in graph_module.graph.nodes)
            captured.append((folded, left, before, after))
            return graph_module

        return aot_module_simplified(gm, inputs, fw_compiler=forward)

    model, q = CachedAttention(groups=3, kv_heads=8), torch.randn(4, 1, 24, 16)
    mask = torch.rand(1, 1, 1, 24) > 0.5
    with torch.no_grad():
        torch.compile(model, backend=backend)(q, mask)
    (folded, left, before, after) = captured[0]
    assert folded == 1 and len(left) == 1 and "folded into query positions" in left[0], left
    assert (before, after) == (2, 1)  # two head repeats out; one expand of the mask over the folded queries in
    compiled = opfuse.optimize(CachedAttention(groups=3, kv_heads=8))  # Inductor on the CPU
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, mask), compiled._orig_mod(q, mask), atol=1e-5, rtol=1e-5)


def test_dynamic_shapes_are_left_as_they_are():
    """With sizes that vary between calls (``dynamic=True``: the batch and the cache length here)
    the rewrite compares no sizes (it runs after the guards were made) and the graph keeps its
    repeat; outputs stay eager's."""

    def attention(q, k, v):
        k, v = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
        return F.scaled_dot_product_attention(q, k, v)

    compiled = opfuse.optimize(attention, dynamic=True, options=EAGER)
    for batch, length in ((4, 24), (5, 40)):
        q, k, v = torch.randn(batch, 16, 1, 16), torch.randn(batch, 4, length, 16), torch.randn(batch, 4, length, 16)
        with torch.no_grad():
            torch.testing.assert_close(compiled(q, k, v), attention(q, k, v), atol=1e-5, rtol=1e-5)
    assert not any("the cache read unrepeated" in n for n in notes(compiled))


@pytest.mark.parametrize("inductor", [False, True])
def test_the_decode_attention_op_in_a_compiled_graph(inductor):
    """``grouped_query_attention="decode_attention"`` writes opfuse's op into the graph; on the CPU
    only its reference runs, so it is forced here (on GPUs its Triton kernels: tests/gpu)."""
    torch.manual_seed(2)
    model, q = CachedAttention(batch=1, kv_heads=2, groups=4), torch.randn(1, 1, 8, 16)
    mask = torch.rand(1, 1, 1, 24) > 0.4
    with opfuse.config.override(grouped_query_attention="decode_attention", force_impl="decode_attention=reference"):
        compiled = opfuse.optimize(model, options=None if inductor else EAGER)
        with torch.no_grad():
            got = compiled(q, mask)
    torch.testing.assert_close(got, model(q, mask), atol=1e-5, rtol=1e-5)
    assert any("decode_attention=reference, the cache read unrepeated" in n for n in notes(compiled)), notes(compiled)


def test_a_bare_forced_name_of_another_family_leaves_auto_to_its_rule():
    """``OPFUSE_FORCE_IMPL=cuda`` forces the ops that have a ``cuda`` implementation; ``decode_attention``
    has none, so ``auto`` chooses as it would (on the CPU: the fold) instead of failing."""
    torch.manual_seed(4)
    model, q = CachedAttention(), torch.randn(4, 1, 16, 16)
    with opfuse.config.override(force_impl="cuda"):
        compiled = opfuse.optimize(model, options=EAGER)
        with torch.no_grad():
            got = compiled(q)
    torch.testing.assert_close(got, model(q), atol=1e-5, rtol=1e-5)
    assert any("query groups folded into query positions" in n for n in notes(compiled)), notes(compiled)


@pytest.mark.parametrize("q, k, v, mask, message", [
    ((2, 8, 3, 16), (2, 4, 24, 16), (2, 4, 24, 16), None, r"query of shape \[2, 8, 3, 16\]; expected \[batch, heads, 1"),
    ((2, 8, 1, 16), (2, 3, 24, 16), (2, 3, 24, 16), None, "8 query heads over 3 key/value heads"),
    ((2, 8, 1, 16), (1, 4, 24, 16), (1, 4, 24, 16), None, r"key of shape \[1, 4, 24, 16\]; expected \[2, kv_heads"),
    ((2, 8, 1, 16), (2, 4, 24, 16), (2, 4, 20, 16), None, r"value of shape \[2, 4, 20, 16\]"),
    ((2, 8, 1, 16), (2, 4, 24, 16), (2, 4, 24, 16), (2, 8, 1, 24), r"mask of shape \[2, 8, 1, 24\]"),
    ((2, 8, 1, 16), (2, 4, 24, 16), (2, 4, 24, 16), (2, 1, 1, 23), r"expected \[2 or 1, 1, 1, 24\]"),
])
def test_decode_attention_names_the_operand_it_refuses(q, k, v, mask, message):
    from opfuse.families.attention import DecodeAttention

    op = DecodeAttention()
    with pytest.raises(ValueError, match=message):
        op(torch.randn(q), torch.randn(k), torch.randn(v), None if mask is None else torch.zeros(mask, dtype=torch.bool))
    with pytest.raises(ValueError, match="key dtype torch.float16; expected the query's, torch.float32"):
        op(torch.randn(2, 8, 1, 16), torch.randn(2, 4, 24, 16).half(), torch.randn(2, 4, 24, 16))
    with pytest.raises(ValueError, match="mask dtype torch.int64"):
        op(torch.randn(2, 8, 1, 16), torch.randn(2, 4, 24, 16), torch.randn(2, 4, 24, 16),
           torch.zeros(2, 1, 1, 24, dtype=torch.long))


def test_decode_attention_with_its_own_value_dim_runs_through_the_reference():
    """A value head dim unlike the query's (SDPA allows it): the reference takes it, exact."""
    from opfuse.families.attention.op import DECODE_ATTENTION

    torch.manual_seed(6)
    q, k, v = torch.randn(2, 8, 1, 16), torch.randn(2, 4, 24, 16), torch.randn(2, 4, 24, 40)
    got = DECODE_ATTENTION(q, k, v, None, 0.25, "reference")
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                            scale=0.25)
    assert got.shape == (2, 8, 1, 40)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case, reason", [
    ("prefill", "3 query positions (only decode, one position, reads them unrepeated)"),
    ("causal", "a causal mask"),
    ("mask per head", "the mask has shape [1, 16, 1, 24]"),
    ("one sequence", "batch x key/value heads = 1 x 4 < 16"),
    ("training", "outputs besides the attention's result are used (a training graph)"),
])
def test_attentions_that_cannot_be_folded_say_why(case, reason):
    torch.manual_seed(1)
    batch = 1 if case == "one sequence" else 4
    model = CachedAttention(batch=batch, causal=case == "causal")
    q = torch.randn(batch, 3 if case == "prefill" else 1, 16, 16, requires_grad=case == "training")
    mask = torch.randn(1, 16, 1, 24) if case == "mask per head" else None
    compiled = opfuse.optimize(model, options=EAGER)
    with torch.set_grad_enabled(case == "training"):
        got, want = compiled(q, mask), model(q, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if case == "training":
        got.sum().backward()
    found = [n for n in notes(compiled) if "over key/value heads repeated 4 times: left repeated" in n]
    assert found and reason in found[0], notes(compiled)
    assert not any("the cache read unrepeated" in n for n in notes(compiled))


def test_llama_decode_with_a_kv_cache_folds_every_layer_and_matches_eager():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    try:
        import llama_tp
    finally:
        sys.path.pop(0)
    cfg = llama_tp.Config(dim=64, layers=2, heads=16, kv_heads=4, ffn=128, vocab=96, max_seq=32)
    model = llama_tp.unsharded(cfg)
    model.setup_caches(batch=4, max_seq=32)
    tokens, pos = torch.randint(0, cfg.vocab, (4, 1)), torch.tensor([5])
    for layer in model.layers:
        for buf in (layer.attention.kv_cache.k, layer.attention.kv_cache.v):
            buf.copy_(torch.randn(buf.shape))
    with torch.no_grad():
        want = model(tokens, pos)  # writes position 5; the compiled call writes the same values again
    compiled = opfuse.optimize(model, options=EAGER)
    with torch.no_grad():
        got = compiled(tokens, pos)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert sum("the cache read unrepeated" in n for n in notes(compiled)) == 2, notes(compiled)


def test_hugging_face_llama_decode_with_a_static_cache_reads_it_unrepeated():
    """Hugging Face's Llama (SDPA attention, ``repeat_kv``, a 4-d mask) decoding two tokens from a
    ``StaticCache``: every layer's attention reads the cache unrepeated, the logits and the cache the
    compiled steps write equal eager's."""
    transformers = pytest.importorskip("transformers")
    import copy

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=16,
                                   num_key_value_heads=4, vocab_size=256, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).eval()
    cache = transformers.StaticCache(config=cfg, max_batch_size=4, max_cache_len=32)
    with torch.no_grad():  # prefill, eager: 6 positions of the cache written
        token = model(torch.randint(0, 256, (4, 6)), past_key_values=cache, use_cache=True,
                      cache_position=torch.arange(6)).logits[:, -1:].argmax(-1)
    compiled_cache = copy.deepcopy(cache)
    compiled = opfuse.optimize(model, options=EAGER)
    for position in (6, 7):
        pos = torch.tensor([position])
        with torch.no_grad():
            want = model(token, past_key_values=cache, use_cache=True, cache_position=pos).logits
            got = compiled(token, past_key_values=compiled_cache, use_cache=True, cache_position=pos).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        token = want[:, -1:].argmax(-1)
    def tensors(c):  # transformers >= 4.56 keeps a list of layers; older releases key_cache / value_cache
        layers = getattr(c, "layers", None)
        return [t for layer in layers for t in (layer.keys, layer.values)] if layers is not None \
            else [*c.key_cache, *c.value_cache]

    for got_cache, want_cache in zip(tensors(compiled_cache), tensors(cache)):
        torch.testing.assert_close(got_cache, want_cache)
    assert sum("the cache read unrepeated" in n for n in notes(compiled)) >= 2, notes(compiled)


DECODE_KERNELS = """
import torch
from opfuse.families.attention import reference, triton_impl

torch.manual_seed(0)
cases = [  # batch, kv heads, groups, positions, head dim, dtype, mask
    (1, 4, 8, 1024, 128, torch.float32, "bool"), (3, 2, 6, 37, 80, torch.float32, "float"),
    (2, 3, 1, 1, 64, torch.float32, None), (2, 2, 4, 300, 64, torch.float16, "bool"),
    (1, 1, 16, 65, 32, torch.float32, "late"),
]
for batch, kv_heads, groups, length, dim, dtype, kind in cases:
    q = torch.randn(batch, 1, kv_heads * groups, dim).to(dtype).transpose(1, 2)  # strided, as models pass it
    k, v = (torch.randn(batch, kv_heads, length, dim).to(dtype) for _ in range(2))
    mask = None
    if kind == "bool":  # every split keeps a position or not: the tail hidden, as a decode cache's
        mask = torch.arange(length).view(1, 1, 1, length) < max(1, length // 3)
        mask = mask.expand(batch, 1, 1, length).clone()
        mask[0, ..., 0] = True
    elif kind == "float":
        mask = torch.randn(1, 1, 1, length)
        mask[..., length // 2:] = float("-inf")
    elif kind == "late":  # only the last position visible: every split but one sees nothing
        mask = torch.zeros(1, 1, 1, length, dtype=torch.bool)
        mask[..., -1] = True
    scale = dim ** -0.5
    want = reference.forward(q.float(), k.float(), v.float(), mask, scale)
    got = triton_impl.forward(q, k, v, mask, scale)
    assert got.shape == want.shape and got.dtype == dtype, (got.shape, got.dtype)
    tol = 5e-3 if dtype == torch.float16 else 2e-5
    err = (got.float() - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), (batch, kv_heads, groups, length, dim, dtype, kind, err)
print("ok")
"""


def test_decode_attention_kernels_under_the_triton_interpreter():
    """The split-over-positions kernels (families/attention/triton_kernels.py) under Triton's CPU
    interpreter against the reference: groups of 1-16 (6: not a power of two), head dims 32-128
    (80: not one), caches of 1-1024 positions, splits that see only hidden positions, boolean and
    additive masks (-inf), a strided query, float32 and float16 (the interpreter's bfloat16 dot
    returns garbage: tests/gpu checks bfloat16). Skipped without triton."""
    import subprocess

    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    run = subprocess.run([sys.executable, "-c", DECODE_KERNELS], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


@pytest.mark.parametrize("programs, length, sms", [(4, 1024, 132), (8, 1024, 132), (64, 512, 132), (512, 1024, 132),
                                                   (4, 1, 132), (1, 4097, 132), (3, 37, 4)])
def test_decode_attention_splits_cover_the_cache_once(programs, length, sms):
    """About two programs per SM, never more splits than steps of BLOCK_N positions, and the splits
    (whole steps each) cover every position exactly once."""
    from opfuse.families.attention.triton_impl import BLOCK_N, splits_for

    splits, per_split = splits_for(programs, length, sms)
    assert per_split % BLOCK_N == 0 and splits >= 1
    assert (splits - 1) * per_split < length <= splits * per_split
    assert splits <= -(-length // BLOCK_N)
    assert programs * splits >= min(2 * sms, programs * -(-length // BLOCK_N)) // 2
