"""Hugging Face's Llama, tensor-parallel through its own ``tp_plan``, compiled with opfuse's
torch.compile backend (needs the ``transformers`` package; exits with a one-line notice without it).

A small ``LlamaForCausalLM`` is built from a config (no download), its config's
``base_model_tp_plan`` ("colwise" / "rowwise" per projection) is applied with DTensor's
``parallelize_module``, and ``opfuse.optimize`` compiles it. The all-reduce after every ``o_proj``
and ``down_proj`` fuses with the residual add and the next ``RMSNorm`` (the next layer's
``input_layernorm`` included) without touching the model's code; outputs (and gradients with
``--train``) are checked against the same model run eagerly::

    python examples/hf_llama_tp.py                  # 2 gloo processes on CPU (NCCL with 2+ GPUs)
    python examples/hf_llama_tp.py --train --no-inductor
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch
import torch.distributed as dist

STYLES = ("colwise", "rowwise")


def have_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def build(world: int, dtype=torch.float32, device="cpu", layers: int = 2, seed: int = 0):
    """A small Llama parallelised with its config's tensor-parallel plan."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-5, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from llama_tp import vary_norm_weights

    torch.manual_seed(seed)
    model = vary_norm_weights(LlamaForCausalLM(config).to(device=device, dtype=dtype))
    plan = getattr(config, "base_model_tp_plan", None) or {}
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    expanded = {}
    for pattern, style in plan.items():
        if style not in styles:
            continue  # embeddings and other layouts stay replicated in this example
        names = [pattern.replace("*", str(i)) for i in range(layers)] if "*" in pattern else [pattern]
        expanded.update({name: styles[style]() for name in names})
    if not expanded:
        raise RuntimeError(f"transformers' LlamaConfig has no usable base_model_tp_plan ({plan!r})")
    mesh = init_device_mesh(device if isinstance(device, str) else device.type, (world,))
    parallelize_module(model.model, mesh, expanded)
    return model


def run_check(rank: int, world: int, train: bool = False, inductor: bool = True, layers: int = 2,
              verbose: bool = True):
    """``(errors, programs)`` for the compiled model against the same model run eagerly."""
    import opfuse

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from llama_tp import local_grads, relative_error

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    eager = build(world, device=device, layers=layers)
    mine = build(world, device=device, layers=layers)
    compiled = opfuse.optimize(mine, options={} if inductor else {"inductor": False})
    tokens = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.set_grad_enabled(train):
        want = eager(tokens, use_cache=False).logits
        got = compiled(tokens, use_cache=False).logits
    errors = {"output": relative_error(got, want)}
    if train:
        grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(2)).to(device)
        want.backward(grad)
        got.backward(grad)
        ref, new = local_grads(eager), local_grads(mine)
        errors.update({f"grad {name}": relative_error(new[name], ref[name]) for name in ref})
    programs = opfuse.programs(compiled)
    if verbose and rank == 0:
        for program in programs:
            print(program.explain())
        print(f"compiled vs eager, max relative difference: {max(errors.values()):.2e}")
    return errors, programs


def _worker(rank, world, train, inductor):
    errors, _ = run_check(rank, world, train, inductor)
    bad = {k: v for k, v in errors.items() if not v <= 1e-5}
    if bad:
        raise AssertionError(f"compiled model differs from eager: {bad}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--no-inductor", action="store_true", help="run the fused graphs eagerly")
    parser.add_argument("--world", type=int, default=None)
    args = parser.parse_args(argv)
    if not have_transformers():
        print("hf_llama_tp: needs the transformers package (pip install transformers); skipped")
        return 0
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from opfuse.cli.launch import default_backend, run

    backend, gpus = default_backend()
    run(_worker, args.world or (gpus if backend == "nccl" else 2), args.train, not args.no_inductor, backend=backend)
    print("result: check PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
