"""How far FP8 training's outputs and gradients are from high precision, with nothing else in between:
the Llama-style example (examples/llama_tp.py) tensor-parallel over ``--world`` gloo ranks on the
CPU, float32, compiled by opfuse with an FP8 recipe (emulated exactly as the recipe rounds) and
without, against the same model run eagerly. The FP8 numbers are the recipe's own quantization
error (e4m3 activations and weights, e5m2 gradients): what a GPU run's ``err`` column should show
for FP8, so a larger one there is a bug and a similar one is not.

    PYTHONPATH=. python3 tools/fp8_grad_error.py                   # world 2, 64 tokens, tensor scaling
    PYTHONPATH=. python3 tools/fp8_grad_error.py --recipe row --tokens 256

Prints, per variant, the output's relative error (norm of the difference over the norm) and the
largest and median relative error over every parameter's gradient.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def errors(rank: int, world: int, recipe_name: str, tokens: int) -> dict:
    """``{variant: (output error, max gradient error, median gradient error)}`` on this rank."""
    import llama_tp
    import fp8_variants

    import opfuse

    torch.manual_seed(0)
    cfg = llama_tp.Config()
    full = llama_tp.unsharded(cfg, torch.float32, "cpu")
    models = {v: llama_tp.build("dist", rank, world, cfg, full=full) for v in ("eager", "opfuse fp8", "opfuse")}
    fp8 = dict(fp8=fp8_variants.recipe(recipe_name), fp8_filter=fp8_variants.keep_high_precision)
    fns = {"eager": models["eager"],
           "opfuse fp8": opfuse.optimize(models["opfuse fp8"], options={"inductor": False}, **fp8),
           "opfuse": opfuse.optimize(models["opfuse"], options={"inductor": False})}
    ids = torch.randint(0, cfg.vocab, (1, tokens), generator=torch.Generator().manual_seed(4))
    grad = torch.randn(1, tokens, cfg.vocab, generator=torch.Generator().manual_seed(5))
    results = {}
    for name, fn in fns.items():
        params = [p for p in models[name].parameters() if p.requires_grad]
        out = fn(ids)
        results[name] = (out.detach(), torch.autograd.grad(out, params, grad))
    found = {}
    for name in ("opfuse fp8", "opfuse"):
        grads = sorted(_rel(a, b) for a, b in zip(results[name][1], results["eager"][1]))
        found[name] = (_rel(results[name][0], results["eager"][0]), grads[-1], grads[len(grads) // 2])
    return found


def _worker(rank, world, recipe_name, tokens):
    found = errors(rank, world, recipe_name, tokens)
    if rank == 0:
        for name, (out, worst, median) in found.items():
            print(f"{name:11s} output {out:.2e}   gradients: max {worst:.2e}, median {median:.2e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--recipe", choices=("tensor", "row"), default="tensor")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error(f"--tokens {args.tokens}: expected a positive token count")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from opfuse.cli.launch import run

    run(_worker, args.world, args.recipe, args.tokens, timeout=600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
