"""The residual-norm family's implementations, per fused op in the order they are tried.

The order follows measurements (docs/PERF_NOTES.md); the reference (torch ops + torch.distributed)
comes last and always runs. The peer-memory kernels' choice between one-shot, two-shot and NCCL
then the local kernel follows the crossover table (:mod:`.crossovers`).
"""

from __future__ import annotations

import functools

from ...machinery.implementation import Implementation, ImplementationTable, always
from . import cuda as norm_cuda
from . import cudnn as norm_cudnn
from . import reference as norm_reference
from .fp8 import cuda as norm_quantize_cuda
from .fp8 import triton_impl as norm_quantize_triton

__all__ = ["TABLE"]


def _residual_norm(norm: str, reduces: bool) -> list[Implementation]:
    def bind(fn):
        return functools.partial(fn, norm=norm)

    backward = bind(norm_cuda.norm_backward) if norm != "none" else None
    reference = Implementation("reference", always, bind(norm_reference.forward),
                               bind(norm_reference.backward) if norm != "none" else None,
                               description="torch.distributed all-reduce, then torch add and norm (float32 statistics)")
    if not reduces:
        return [Implementation("cuda", norm_cuda.check_local, bind(norm_cuda.local_forward), backward,
                               description="fused (bias +) residual add + norm kernel"),
                Implementation(norm_cudnn.NAME, norm_cudnn.check, bind(norm_cudnn.forward), bind(norm_cudnn.backward),
                               norm_cudnn.prepare, "torch add, then cuDNN frontend norm graphs (forward; backward "
                                                   "with recomputed statistics); optional: opfuse[cudnn]"),
                reference]
    return [
        Implementation("cuda_oneshot", norm_cuda.check_oneshot, bind(norm_cuda.oneshot_forward), backward,
                       norm_cuda.prepare_oneshot,
                       "one kernel: Lamport one-shot all-reduce over peer memory + add + norm"),
        Implementation("cuda_twoshot_lamport", norm_cuda.check_lamport, bind(norm_cuda.lamport_forward), backward,
                       norm_cuda.prepare_lamport,
                       "one kernel: pipelined two-shot over Lamport peer buffers (no flags, no fences) + add + norm"),
        Implementation("cuda_twoshot", norm_cuda.check_twoshot, bind(norm_cuda.twoshot_forward), backward,
                       norm_cuda.prepare_twoshot,
                       "one kernel: two-shot (reduce-scatter rows, all-gather) over peer memory + add + norm"),
        Implementation("nccl+cuda", norm_cuda.check_nccl_then_kernel, bind(norm_cuda.nccl_then_kernel_forward),
                       backward, description="NCCL all-reduce, then the fused add + norm kernel"),
        reference,
    ]


def _norm_quantize(norm: str) -> list[Implementation]:
    def bind(fn):
        return functools.partial(fn, norm=norm)

    return [
        Implementation("triton", norm_quantize_triton.check, bind(norm_quantize_triton.forward),
                       bind(norm_quantize_triton.backward),
                       description="one Triton kernel per row: (bias +) residual add + norm + FP8 cast (per tensor: "
                                   "an amax pass, then the cast pass)"),
        Implementation("reference", always, bind(norm_reference.forward_quantize), bind(norm_reference.backward),
                       description="the reference add + norm, then the reference quantizer"),
    ]


def _allreduce_norm_quantize(norm: str) -> list[Implementation]:
    """The peer kernels with the FP8 epilogue (the checks, preparation and crossovers of
    ``allreduce_add_*norm``), then a torch.distributed all-reduce composed with each
    implementation of ``add_*norm_quantize`` (its reference last: the unfused chain)."""

    def bind(fn):
        return functools.partial(fn, norm=norm)

    backward = bind(norm_cuda.norm_backward)
    composed = [
        Implementation("reference" if local.name == "reference" else f"allreduce+{local.name}", local.check,
                       norm_reference.allreduce_then(local.forward), local.backward, local.prepare,
                       f"torch.distributed all-reduce (NCCL, gloo), then add_{norm}norm_quantize's "
                       f"{local.name}: {local.description}")
        for local in _norm_quantize(norm)]
    return [
        Implementation("cuda_oneshot", norm_cuda.check_oneshot, bind(norm_quantize_cuda.oneshot_forward), backward,
                       norm_cuda.prepare_oneshot,
                       "one kernel: Lamport one-shot all-reduce over peer memory + add + norm + FP8 cast (per tensor: "
                       "+ the amax reduction and a cast pass over h)"),
        Implementation("cuda_twoshot_lamport", norm_cuda.check_lamport, bind(norm_quantize_cuda.lamport_forward),
                       backward, norm_cuda.prepare_lamport,
                       "one kernel: pipelined two-shot over Lamport peer buffers + add + norm + FP8 cast (per tensor: + "
                       "the amax reduction and a cast pass over h)"),
        Implementation("cuda_twoshot", norm_cuda.check_twoshot, bind(norm_quantize_cuda.twoshot_forward), backward,
                       norm_cuda.prepare_twoshot,
                       "one kernel: two-shot all-reduce over peer memory + add + norm + FP8 cast (per tensor: + the "
                       "amax reduction and a cast pass over h)"),
        *composed,
    ]


TABLE = ImplementationTable("residual_norm", {
    "allreduce_add_rmsnorm": _residual_norm("rms", reduces=True),
    "allreduce_add_layernorm": _residual_norm("layer", reduces=True),
    "add_rmsnorm": _residual_norm("rms", reduces=False),
    "add_layernorm": _residual_norm("layer", reduces=False),
    "allreduce": _residual_norm("none", reduces=True),
    "add_rmsnorm_quantize": _norm_quantize("rms"),
    "add_layernorm_quantize": _norm_quantize("layer"),
    "allreduce_add_rmsnorm_quantize": _allreduce_norm_quantize("rms"),
})
