"""A short training run of a small MLP block, FP8 against high precision (bench/fp8.py's training
comparison; ``tests/unit/test_fp8.py`` runs it on CPU in emulation).

The task: regress the outputs of a fixed random teacher MLP from fresh random inputs (one
generator, so every run sees the same batches). The student is an ``ops.Sequential`` block
(RMSNorm -> Linear -> GELU -> Linear) trained with Adam; ``recipe=None`` trains it in ``dtype``,
a recipe under ``opfuse.fp8.autocast``. Returns the loss per step.
"""

from __future__ import annotations

import torch

import opfuse
from opfuse import ops

__all__ = ["train", "smoothed"]


def smoothed(losses, window: int = 10) -> float:
    """Mean of the last ``window`` losses (single steps are noisy)."""
    tail = losses[-window:]
    return sum(tail) / len(tail)


def train(recipe, *, steps: int = 300, hidden: int = 256, ffn: int = 1024, tokens: int = 256, device="cuda",
          dtype=torch.bfloat16, lr: float = 2e-3, seed: int = 0) -> list[float]:
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    teacher = [rand(ffn, hidden, scale=hidden ** -0.5), rand(hidden, ffn, scale=ffn ** -0.5)]
    block = ops.Sequential(ops.RMSNorm(hidden, device=device, dtype=dtype),
                           ops.Linear(hidden, ffn, device=device, dtype=dtype), ops.GELU("tanh"),
                           ops.Linear(ffn, hidden, device=device, dtype=dtype))
    with torch.no_grad():
        for p in block.parameters():  # the same initial weights for every run
            if p.dim() == 2:
                p.copy_(rand(*p.shape, scale=p.shape[1] ** -0.5))
    optimizer = torch.optim.Adam(block.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        x = rand(tokens, hidden)
        with torch.no_grad():
            target = torch.nn.functional.gelu(torch.nn.functional.rms_norm(x, (hidden,)) @ teacher[0].t(),
                                              approximate="tanh") @ teacher[1].t()
        with opfuse.fp8.autocast(enabled=recipe is not None, recipe=recipe):
            y = block(x.to(dtype))
        loss = (y.float() - target).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
