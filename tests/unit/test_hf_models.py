"""The torch.compile backend on real Hugging Face models (tiny configurations of each
architecture, randomly initialised): outputs, the loss and every parameter's gradient equal the
same model run eagerly, at two sequence lengths, and the fusions each architecture should get are
there. The architectures differ where opfuse's recognition and lowering can go wrong: GPT-2's
Conv1D projections with biases and LayerNorm, Qwen3's and OLMo 2's per-head q/k norms, Gemma 3's
norm of the transposed heads, mixture-of-experts blocks (Mixtral, Qwen2-MoE), DeepSeek-V3's
low-rank attention, Phi's parallel attention and MLP, Qwen2's biased q/k/v, Starcoder2's biases
and LayerNorm (batch 1 and 3 too), GPT-NeoX's parallel residual, Phi-3's fused q/k/v and gate/up
projections, Gemma 2's sandwich norms and soft-capping; one model under ``dynamic=True``.

``options={"inductor": False}``: the fused graphs run without code generation (minutes of C++
compilation on a CI host otherwise); Inductor's own code is not what these tests check.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import opfuse

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=96)

#: architecture -> (config overrides, fusions every compiled graph set must include)
ARCHITECTURES = {
    "llama": ({}, {"add_rmsnorm", "horizontal_gemm"}),
    "gpt2": (dict(n_embd=32, n_layer=2, n_head=4, vocab_size=96), {"add_layernorm"}),
    "qwen3": (dict(head_dim=8), {"add_rmsnorm", "horizontal_gemm"}),
    "gemma3_text": (dict(head_dim=8), {"add_rmsnorm", "horizontal_gemm"}),
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2), {"add_rmsnorm", "horizontal_gemm"}),
    "deepseek_v3": (dict(num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                         n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                         qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8), {"add_rmsnorm"}),
    "phi": (dict(num_key_value_heads=4), {"add_layernorm"}),
    # Biased q/k/v projections (one merged GEMM with its biases).
    "qwen2": ({}, {"add_rmsnorm", "horizontal_gemm"}),
    # Biases on every projection, LayerNorm with a bias, a GELU MLP.
    "starcoder2": ({}, {"add_layernorm", "horizontal_gemm"}),
    # Parallel residual (attention and MLP read the same input), q/k/v stored as one projection.
    "gpt_neox": ({}, {"add_layernorm"}),
    # q/k/v and gate/up stored fused (qkv_proj, gate_up_proj): nothing to merge, norms still fuse.
    "phi3": (dict(pad_token_id=0), {"add_rmsnorm"}),
    # Sandwich norms (a norm after attention and after the MLP, before the residual add), Gemma's
    # (1 + weight) RMSNorm, attention and final-logit soft-capping; transformers runs it eagerly only.
    "gemma2": (dict(head_dim=8, attn="eager"), {"add_rmsnorm", "horizontal_gemm"}),
}
#: Further architectures the other tests build.
_MORE = {"qwen2_moe": dict(moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4,
                           num_experts_per_tok=2)}


def _model(name: str):
    overrides = dict(ARCHITECTURES[name][0] if name in ARCHITECTURES else _MORE[name])
    attention = overrides.pop("attn", "sdpa")
    settings = dict(overrides) if "n_embd" in overrides else {**_DECODER, **overrides}
    config = transformers.AutoConfig.for_model(name, **settings)
    config._attn_implementation = attention
    torch.manual_seed(0)
    # eval(): the same function in both copies (no dropout); gradients still flow.
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _check_training(model, eager, compiled, shapes):
    """``compiled`` (over ``model``) gives ``eager``'s logits, loss gradients and unused
    parameters at each (batch, length) in ``shapes``."""
    generator = torch.Generator().manual_seed(1)
    for batch, length in shapes:
        tokens = torch.randint(0, 96, (batch, length), generator=generator)
        got, want = compiled(tokens, labels=tokens), eager(tokens, labels=tokens)
        torch.testing.assert_close(got.logits, want.logits, atol=2e-5, rtol=1e-5)
        got.loss.backward()
        want.loss.backward()
        for (key, param), reference in zip(model.named_parameters(), eager.parameters()):
            assert (param.grad is None) == (reference.grad is None), key
            if param.grad is not None:
                torch.testing.assert_close(param.grad, reference.grad, atol=2e-5, rtol=1e-4, msg=key)
        model.zero_grad()
        eager.zero_grad()


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_a_hugging_face_model_trains_as_it_does_eagerly(name):
    model = _model(name)
    eager = copy.deepcopy(model)
    compiled = opfuse.optimize(model, options={"inductor": False})
    # A second shape recompiles (static shapes): checked where shapes matter most (CI time).
    shapes = {"qwen3": [(2, 12), (2, 7)], "mixtral": [(2, 12), (2, 7)], "starcoder2": [(2, 12), (3, 7), (1, 2)]}
    _check_training(model, eager, compiled, shapes.get(name, [(2, 12)]))
    fused = {f.rule for program in opfuse.programs(compiled) for f in program.fusions}
    assert ARCHITECTURES[name][1] <= fused, fused


def test_a_hugging_face_model_keeps_its_norm_fusions_under_dynamic_true():
    """``dynamic=True``: Dynamo passes each RMSNorm's ``variance_epsilon`` (a float attribute) as a
    graph input; opfuse has it specialised again, so every add + RMSNorm still fuses (none did),
    with eager's loss and gradients at two shapes from one graph."""
    model = _model("llama")
    eager = copy.deepcopy(model)
    compiled = opfuse.optimize(model, options={"inductor": False}, dynamic=True)
    _check_training(model, eager, compiled, [(2, 12), (3, 7)])
    (program,) = opfuse.programs(compiled)
    # Each layer's two norms and the final one, after the embedding or a residual add.
    assert [f.rule for f in program.fusions_in("forward")].count("add_rmsnorm") == 5, program.explain()


def test_a_deep_copy_of_a_compiled_model_runs_on_its_own_weights():
    """``copy.deepcopy`` of an optimized model (an EMA or frozen copy) copies Dynamo's wrappers down
    to opfuse's backend, whose programs hold fake tensors (the copy failed: "Cannot access data
    pointer of Tensor"). The copy gets a backend of its own over the copied model: its results
    follow its own weights (still stored back to back for the merged q/k/v), the original's stay."""
    model = _model("llama")
    compiled = opfuse.optimize(model, options={"inductor": False})
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    compiled(tokens, labels=tokens).loss.backward()
    twin = copy.deepcopy(compiled)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for m in (twin._orig_mod, reference):
            m.model.layers[0].self_attn.k_proj.weight.mul_(2)
        torch.testing.assert_close(twin(tokens).logits, reference(tokens).logits, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(compiled(tokens).logits, model(tokens).logits, atol=2e-5, rtol=1e-5)
    assert opfuse.programs(twin) and not set(map(id, opfuse.programs(twin))) & set(map(id, opfuse.programs(compiled)))


@pytest.mark.parametrize("name, cache", [("qwen3", None), ("gemma2", "static")])
def test_a_hugging_face_model_generates_as_it_does_eagerly(name, cache):
    """Inference under ``torch.no_grad`` with a KV cache (``generate``: a prefill graph, then
    one-token steps); Gemma 2 with a static cache (sliding-window and global layers)."""
    model = _model(name)
    eager = copy.deepcopy(model)
    model.forward = opfuse.optimize(model.forward, options={"inductor": False})
    prompt = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation=cache)
    with torch.no_grad():
        assert torch.equal(model.generate(prompt, **settings), eager.generate(prompt, **settings))


def test_batched_generation_with_merged_qkv_and_per_head_norms():
    """Qwen3 normalises q and k per head (``view(B, S, heads, head_dim)``), and opfuse flattens that
    to ``[-1, head_dim]`` for the fused norm. Once q and k are column slices of the merged q/k/v
    GEMM's output, that view cannot be taken at one token per sequence and batch > 1 (every decoding
    step of a batched ``generate``), but torch's fake tensors said it could, so no copy was inserted
    and the graph failed when it ran ("view size is not compatible with input tensor's size and
    stride"). The merged weights come from ``prepare_model``, as ``opfuse.optimize(model)`` makes them."""
    model = _model("qwen3")
    eager = copy.deepcopy(model)
    opfuse.torch_compile.prepare_model(model)
    model.forward = opfuse.optimize(model.forward, options={"inductor": False})
    prompt = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(2))
    settings = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(prompt, **settings), eager.generate(prompt, **settings))
    assert "horizontal_gemm" in {f.rule for program in opfuse.programs(model.forward) for f in program.fusions}


@pytest.mark.parametrize("name, dtype", [("qwen2_moe", torch.bfloat16), ("qwen2_moe", torch.float16)], ids=["bf16", "fp16"])
def test_hugging_face_grouped_mm_experts_become_grouped_gemms(name, dtype, tmp_path):
    """transformers 5 runs bf16 experts as ``torch._grouped_mm`` over offsets from a ``histc`` of
    the expert ids (float counts on CPU), one offsets tensor for every grouped GEMM; float16 experts
    under torch.compile call its ``grouped_mm_fallback`` op (a loop over host offsets) the same way.
    Each becomes opfuse's ``grouped_linear`` (its implementation chosen per shape), with eager's loss
    and gradients; Qwen2-MoE adds a gated shared expert beside them (Mixtral's experts: the FP8
    test below)."""
    model = _model(name).to(dtype)
    eager = copy.deepcopy(model)
    compiled = opfuse.optimize(model, options={"inductor": False})
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with opfuse.config.override(dump_dir=str(tmp_path)):
        got = compiled(tokens, labels=tokens)
    want = eager(tokens, labels=tokens)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(got.logits, want.logits, atol=tol, rtol=tol)
    got.loss.backward()
    want.loss.backward()
    (folder,) = os.listdir(tmp_path)
    after = (tmp_path / folder / "aten_after.py").read_text()
    # No host-synchronising loop is left, forward or backward.
    assert "ops.transformers.grouped_mm_fallback" not in after, \
        [line.strip() for line in after.splitlines() if "ops.transformers.grouped_mm_fallback" in line]
    for (key, param), reference in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(param.grad, reference.grad, atol=tol, rtol=tol, msg=key)
    rules = [f.rule for program in opfuse.programs(compiled) for f in program.fusions]
    # gate + up (one grouped GEMM over [E, 2F, H]) and down, per MoE layer, in the forward.
    assert rules.count("grouped_linear") == 2 * 2, rules


def test_hugging_face_float32_experts_stay_with_transformers():
    """Float32 experts (transformers' ``grouped_mm_fallback`` too) are left as they are: a float32
    grouped GEMM on FMA units is not known to beat transformers' per-expert SGEMMs."""
    compiled = opfuse.optimize(_model("qwen2_moe"), options={"inductor": False})
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    compiled(tokens, labels=tokens).loss.backward()
    rules = [f.rule for program in opfuse.programs(compiled) for f in program.fusions]
    assert "grouped_linear" not in rules, rules


def test_hugging_face_stacked_experts_under_fp8_keep_their_router_in_high_precision():
    """FP8 inference of a transformers 5 Mixtral: the experts' grouped GEMMs run in FP8, the router
    (a plain [experts, hidden] linear, not rewritten by opfuse) stays in high precision."""
    model = _model("mixtral").bfloat16()
    compiled = opfuse.optimize(model, fp8=opfuse.fp8.TensorScaling(), options={"inductor": False})
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = compiled(tokens).logits.float(), _model("mixtral").bfloat16()(tokens).logits.float()
    assert ((got - want).norm() / want.norm()).item() < 0.1  # the recipe's rounding (e4m3), not a wrong result
    (program,) = opfuse.programs(compiled)
    assert [f.rule for f in program.fusions].count("grouped_linear_fp8") == 2 * 2
    text = program.explain()
    assert "model.layers.0.mlp.gate (MoE router: routing stays in high precision)" in text, text
    assert "experts stored stacked, no rewrite needed" in text, text
