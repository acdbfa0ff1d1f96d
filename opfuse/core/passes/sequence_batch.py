"""Where sequence parallelism's batch > 1 fusions may run.

At batch > 1 a sequence-sharded model reorders rows around each collective (``split`` + ``cat``);
the ``all_gather_keep`` and ``linear_reduce_scatter_batch`` passes fold that reorder into the fused
op. On CPU (gloo, the reference implementations, with and without Inductor) the result equals the
eager model's to float32 rounding. On 2x H200 the same model's training step at batch 4 gave
gradients far from eager's (relative error 1.4, docs/PERF_NOTES.model.md, session 7) while the
fused ops themselves saw the shapes of batch 1 (where they are right): the cause is not found, so
these fusions stay off for CUDA tensors until a GPU run shows them right. Batch 1 is not affected.
"""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["batch_fusion_refused"]


def batch_fusion_refused(ctx, node: fx.Node, what: str) -> bool:
    """``True`` (with a note for ``explain()``) where a batch > 1 fusion at ``node`` must not run."""
    meta = ctx.meta(node)
    if meta is None or torch.device(meta.device).type != "cuda":
        return False
    ctx.note(f"{node.name}: {what} at batch > 1 left unfused on CUDA tensors (wrong gradients measured on "
             f"GPUs, cause not found: opfuse/core/passes/sequence_batch.py)")
    return True
