"""Where sequence parallelism's batch > 1 gather fusion may run.

At batch > 1 a sequence-sharded model reorders rows around each collective (``split`` + ``cat``);
the ``all_gather_keep`` and ``linear_reduce_scatter_batch`` passes fold that reorder into the fused
op. On CPU (gloo, the reference implementations, with and without Inductor) the result equals the
eager model's to float32 rounding. On GPUs (train-sp at batch 4, world 2) the gradients of the k and
v projections' weights are wrong (relative error 1.4-1.6) when ``all_gather_keep``'s regroup runs in
a graph that Inductor's async TP (``_micro_pipeline_tp``) also rewrites; without async TP, and for
``linear_reduce_scatter_batch`` with it, they match eager's (``tools/sp_async_tp_bisect.py``;
docs/PERF_NOTES.model.md). The keep's reference implementation (no peer memory) is as wrong as its
peer-memory one, and on CPU the same async-TP rewrites with torch's reference symm-mem ops are
right, so the fault lies in the CUDA path of the rewrites async TP makes around the keep; until it
is found, on CUDA tensors the batch > 1 gather fusion stays off while async TP is on for the graph
being compiled. Batch 1 is not affected.
"""

from __future__ import annotations

import contextlib

import torch
from torch import fx

__all__ = ["batch_fusion_refused", "async_tp_on", "refusal_lifted"]

_lifted = False


def async_tp_on() -> bool:
    """Whether Inductor's async TP (micro-pipeline TP) runs on the graph being compiled: the pass
    runs inside Inductor's compile, so its config holds the compile's own options."""
    from torch._inductor import config as inductor_config

    return bool(getattr(inductor_config, "_micro_pipeline_tp", False))


def batch_fusion_refused(ctx, node: fx.Node, what: str) -> bool:
    """``True`` (with a note for ``explain()``) where a batch > 1 fusion at ``node`` must not run."""
    meta = ctx.meta(node)
    if _lifted or meta is None or torch.device(meta.device).type != "cuda" or not async_tp_on():
        return False
    ctx.note(f"{node.name}: {what} at batch > 1 left unfused on CUDA tensors while Inductor's async TP is on "
             f"(the two together gave wrong weight gradients on GPUs, cause not found: "
             f"opfuse/core/passes/sequence_batch.py)")
    return True


@contextlib.contextmanager
def refusal_lifted(lifted: bool = True):
    """Compile with the refusal above lifted (``lifted=False``: as it is), to diagnose the pair on
    GPUs (tools/sp_async_tp_bisect.py, bench/model.py's ``opfuse:sp-batch-on`` variants)."""
    global _lifted
    saved, _lifted = _lifted, lifted or _lifted
    try:
        yield
    finally:
        _lifted = saved
