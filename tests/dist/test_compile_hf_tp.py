"""The torch.compile backend on real Hugging Face models sharded by transformers itself
(``from_pretrained(..., tp_plan="auto")``, DTensor parameters, 2 gloo ranks): the loss, the
logits and every parameter's gradient equal the unsharded model's, and each row-parallel
projection's all-reduce fuses with the residual add and the next norm. Qwen2-MoE (experts, a
shared expert, biased q/k/v), Starcoder2 (biased output projections, LayerNorm) and Phi-3 (fused
q/k/v and gate/up projections);
Llama is ``tests/dist/test_compile_backend.py::test_transformers_llama_with_its_tp_plan``, Qwen2's
inference ``tests/dist/test_compile_hf.py``.
"""

from __future__ import annotations

import pytest
import torch

from ..transformers_support import tp_auto
from .harness import run

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
pytest.importorskip("accelerate", reason="transformers' tp_plan needs accelerate (pip install -e '.[test]')")

_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=96)

#: architecture -> (config overrides, the fused all-reduce + add + norm rule, how many fuse): the
#: embedding's all-reduce (sharded by vocabulary) with layer 0's first norm, then each layer's
#: attention and MLP all-reduces with the next norm. Qwen2-MoE's plan leaves the experts unsharded
#: (transformers says its MLP rules "match nothing"): no all-reduce after them, an add + norm.
ARCHITECTURES = {
    "qwen2_moe": (dict(moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4,
                       num_experts_per_tok=2), "allreduce_add_rmsnorm", 3),
    "starcoder2": ({}, "allreduce_add_layernorm", 5),
    # q/k/v and gate/up stored as one projection each, sharded by transformers' packed rules.
    "phi3": (dict(pad_token_id=0), "allreduce_add_rmsnorm", 5),
}


def _check(rank, world, folder):
    import opfuse

    for name, (_, fused_rule, count) in ARCHITECTURES.items():
        torch._dynamo.reset()
        path = f"{folder}/{name}"
        whole = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        sharded = transformers.AutoModelForCausalLM.from_pretrained(path, **tp_auto()).eval()
        compiled = opfuse.optimize(sharded, options={"inductor": False})
        tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
        got, want = compiled(tokens, labels=tokens), whole(tokens, labels=tokens)
        torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
        logits = got.logits.full_tensor() if hasattr(got.logits, "full_tensor") else got.logits
        torch.testing.assert_close(logits, want.logits, atol=1e-5, rtol=1e-5)
        got.loss.backward()
        want.loss.backward()
        for (key, param), reference in zip(sharded.named_parameters(), whole.parameters()):
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            torch.testing.assert_close(grad, reference.grad, atol=1e-5, rtol=1e-4, msg=f"{name}: {key}")
        rules = [f.rule for program in opfuse.programs(compiled) for f in program.fusions]
        assert rules.count(fused_rule) == count, (name, rules)


@pytest.mark.dist
def test_hugging_face_tensor_parallel_models_compile_and_train_as_unsharded(tmp_path):
    for name, (overrides, _, _) in ARCHITECTURES.items():
        config = transformers.AutoConfig.for_model(name, **{**_DECODER, **overrides})
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / name)
    run(_check, 2, str(tmp_path))
