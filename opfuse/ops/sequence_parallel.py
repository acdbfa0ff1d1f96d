"""Gradients of sequence-parallel parameters: the norm weights and row-parallel biases that act on
token-sharded activations hold per-rank partial sums after ``backward()``, as in Megatron-LM;
:func:`sync_sequence_parallel_grads` sums them."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from . import group as groups

__all__ = ["sync_sequence_parallel_grads"]


def sync_sequence_parallel_grads(module: torch.nn.Module) -> int:
    """All-reduce (sum) the gradients of parameters that act on token-sharded activations.

    With ``sequence_parallel=True`` each rank sees only its tokens in the norm layers and the
    row-parallel bias, so their ``.grad`` is a partial sum; call this after ``backward()`` and
    before the optimizer step (the compile step marks such parameters with
    ``param.sequence_parallel = True``). With gradient accumulation, call it once, after the
    last backward of the step. Returns the number of gradients reduced.

    Misuse that would train on partial or over-counted gradients raises ``RuntimeError``: a call
    before ``backward()`` (no marked trainable parameter has a gradient yet: the ones the
    backward makes would stay partial sums) and a second call for the same backward (a gradient
    reduced before and unchanged since: reducing it again multiplies it by the world size). A
    module with no marked parameter (not sequence parallel, or not called yet: blocks mark their
    parameters when they compile, on their first call) has nothing to reduce: a ``UserWarning``
    says so and the call returns 0, so a training loop may call it whatever its parallelism.

    Examples
    --------
    >>> loss.backward()                                   # doctest: +SKIP
    >>> opfuse.sync_sequence_parallel_grads(model)        # doctest: +SKIP
    >>> optimizer.step()                                  # doctest: +SKIP
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"opfuse.sync_sequence_parallel_grads: module={module!r} ({type(module).__name__}); "
                        f"expected a torch.nn.Module (the model whose backward ran)")
    marked = [p for p in module.parameters() if getattr(p, "sequence_parallel", False)]
    name = type(module).__name__
    if not marked:
        warnings.warn(f"opfuse.sync_sequence_parallel_grads: no parameter of this {name} acts on token-sharded "
                      f"activations, nothing to reduce (blocks with sequence_parallel=True mark theirs when they "
                      f"compile, on their first call)", UserWarning, stacklevel=2)
        return 0
    trainable = [p for p in marked if p.requires_grad]
    ready = [p for p in trainable if p.grad is not None]
    if trainable and not ready:
        raise RuntimeError(f"opfuse.sync_sequence_parallel_grads: none of the {len(trainable)} sequence-parallel "
                           f"parameters of this {name} has a gradient yet; call it after loss.backward() and before "
                           f"optimizer.step()")
    again = [p for p in ready if getattr(p.grad, "_opfuse_reduced_version", None) == p.grad._version]
    if again:
        raise RuntimeError(f"opfuse.sync_sequence_parallel_grads: {len(again)} of the gradients of this {name} were "
                           f"already reduced and have not changed since (reducing them again multiplies them by the "
                           f"world size); call it once after each backward")
    for param in ready:
        dist.all_reduce(param.grad, group=groups.resolve(getattr(param, "sequence_parallel_group", None)))
        # The version after the reduction: a backward that accumulates into this tensor, or a
        # zero_grad() that zeroes it in place, moves it on.
        param.grad._opfuse_reduced_version = param.grad._version
    return len(ready)
