"""The implementation table: for every fused op, its implementations in the order they are tried.

This list is the registration (nothing registers itself on import). A program's
``select_implementations`` pass takes the first capable implementation of each fused op
(:func:`opfuse.backend.registry.choose`) and records it in ``Program.fusions``; the reference
implementation at the end of each list always runs (torch ops + ``torch.distributed``, CPU and
gloo included). The order follows measurements (docs/PERF_NOTES*.md); an op in
``MEASURED_ORDER`` is reordered per call from measurements per GPU kind and size class. Adding an
implementation is one line here; adding a fused op is one entry here plus its family folder and
its rule.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

from .collective_linear import cublasmp as collective_cublasmp
from .collective_linear import fp8_nccl as collective_fp8_nccl
from .collective_linear import fp8_p2p as collective_fp8_p2p
from .collective_linear import fp8_reference as collective_fp8_reference
from .collective_linear import p2p as collective_p2p
from .fp8_grouped_linear import reference as fp8_grouped_reference
from .fp8_grouped_linear import scaled_grouped_mm
from .fp8_linear import reference as fp8_linear_reference
from .fp8_linear import scaled_mm
from .collective_linear import reference as collective_reference
from .grouped_linear import cudnn as grouped_cudnn
from .grouped_linear import reference as grouped_reference
from .gated_activation import reference as gated_reference
from .gated_activation import triton_impl as gated_triton
from .grouped_linear import persistent as grouped_persistent
from .grouped_linear import torch_mm, triton_impl
from .grouped_linear import tuning as grouped_tuning
from .horizontal_linear import checks as horizontal_checks
from .horizontal_linear import reference as horizontal_reference
from .linear_activation import cublaslt
from .linear_activation import cudnn as activation_cudnn
from .linear_activation import reference as activation_reference
from .quantize import reference as quantize_reference
from .quantize import triton_impl as quantize_triton
from .registry import CallSpec, Implementation, ImplementationError
from .residual_norm import cuda as norm_cuda
from .residual_norm import cudnn as norm_cudnn
from .residual_norm import quantize_cuda as norm_quantize_cuda
from .residual_norm import quantize_triton as norm_quantize_triton
from .residual_norm import reference as norm_reference

__all__ = ["TABLE", "MEASURED_ORDER", "for_op", "get", "names"]


def _always(spec) -> None:
    return None


def _residual_norm(norm: str, reduces: bool) -> list[Implementation]:
    def bind(fn):
        return functools.partial(fn, norm=norm)

    backward = bind(norm_cuda.norm_backward) if norm != "none" else None
    reference = Implementation("reference", _always, bind(norm_reference.forward),
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
        Implementation("reference", _always, bind(norm_reference.forward_quantize), bind(norm_reference.backward),
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


TABLE: dict[str, list[Implementation]] = {
    "allreduce_add_rmsnorm": _residual_norm("rms", reduces=True),
    "allreduce_add_layernorm": _residual_norm("layer", reduces=True),
    "add_rmsnorm": _residual_norm("rms", reduces=False),
    "add_layernorm": _residual_norm("layer", reduces=False),
    "allreduce": _residual_norm("none", reduces=True),
    "add_rmsnorm_quantize": _norm_quantize("rms"),
    "add_layernorm_quantize": _norm_quantize("layer"),
    "allreduce_add_rmsnorm_quantize": _allreduce_norm_quantize("rms"),
    "all_gather_linear": [
        Implementation(collective_p2p.NAME, collective_p2p.check_all_gather_linear,
                       collective_p2p.all_gather_linear_forward, collective_p2p.all_gather_linear_backward,
                       collective_p2p.prepare,
                       "token all-gather pushed over peer memory (copy engine) while cuBLAS GEMMs each arrived shard; "
                       "backward: dgrad reduce-scatter + input re-gather for wgrad"),
        Implementation(collective_cublasmp.NAME, collective_cublasmp.check_all_gather_linear,
                       collective_cublasmp.all_gather_linear_forward, collective_cublasmp.all_gather_linear_backward,
                       collective_cublasmp.prepare,
                       "cuBLASMp 0.7 all-gather matmul (split P2P pipeline); backward: cuBLASMp reduce-scatter "
                       "matmul for dgrad, NCCL re-gather for wgrad; optional: opfuse[cublasmp]"),
        Implementation("reference", _always, collective_reference.ag_linear_forward,
                       collective_reference.ag_linear_backward, description="all-gather, then one GEMM"),
    ],
    "linear_reduce_scatter": [
        Implementation(collective_p2p.NAME, collective_p2p.check_linear_reduce_scatter,
                       collective_p2p.linear_reduce_scatter_forward, collective_p2p.linear_reduce_scatter_backward,
                       collective_p2p.prepare,
                       "GEMM sub-chunks whose partial sums are pushed over peer memory and summed on their owner "
                       "(ring or direct); backward: dy all-gather overlapped with dgrad"),
        Implementation(collective_cublasmp.NAME, collective_cublasmp.check_linear_reduce_scatter,
                       collective_cublasmp.linear_reduce_scatter_forward,
                       collective_cublasmp.linear_reduce_scatter_backward, collective_cublasmp.prepare,
                       "cuBLASMp 0.7 reduce-scatter matmul (split P2P pipeline); backward: cuBLASMp all-gather "
                       "matmul for dgrad, NCCL gather of dy for wgrad; optional: opfuse[cublasmp]"),
        Implementation("reference", _always, collective_reference.linear_rs_forward,
                       collective_reference.linear_rs_backward, description="one GEMM, then reduce-scatter"),
    ],
    "gated_activation": [
        Implementation("triton", gated_triton.check, gated_triton.forward, gated_triton.backward,
                       description="one pass over the packed [gate | up] rows, float32 arithmetic, rounded once"),
        Implementation("reference", _always, gated_reference.forward, gated_reference.backward,
                       description="torch: the two halves, the activation, the product (float32 for half types)"),
    ],
    "horizontal_linear": [
        Implementation(collective_p2p.NAME, horizontal_checks.check_p2p, collective_p2p.all_gather_linear_forward,
                       collective_p2p.all_gather_linear_backward, horizontal_checks.prepare_p2p,
                       "sequence parallel: all_gather_linear's overlap over the joined weight (one wider GEMM)"),
        Implementation("reference", _always, horizontal_reference.forward, horizontal_reference.backward,
                       description="one GEMM over the joined weight (all-gather first when sequence parallel)"),
    ],
    "linear_bias_activation": [
        Implementation("cublaslt_epilogue", cublaslt.check, cublaslt.forward, activation_reference.backward,
                       description="cuBLASLt GEMM with bias+GELU(tanh) epilogue"),
        Implementation(activation_cudnn.NAME, activation_cudnn.check, activation_cudnn.forward,
                       activation_reference.backward, activation_cudnn.prepare,
                       "cuDNN frontend matmul + bias + GELU (exact or tanh) graph, pre-activation kept for "
                       "training; optional: opfuse[cudnn]"),
        Implementation("reference", _always, activation_reference.forward, activation_reference.backward,
                       description="addmm, then gelu"),
    ],
    "grouped_linear": [
        Implementation("triton", triton_impl.check, triton_impl.forward, triton_impl.backward,
                       description="Triton grouped GEMM, pointer loads (any size), device group sizes"),
        Implementation("triton_tma", triton_impl.check_tma, triton_impl.forward_tma, triton_impl.backward_tma,
                       description="Triton grouped GEMM, TMA loads, device group sizes, fused bias, zeroed tail"),
        Implementation("torch_grouped_mm", torch_mm.check, torch_mm.forward, torch_mm.backward,
                       description="torch._grouped_mm (CUTLASS) with device offsets, tail and empty groups zeroed"),
        Implementation(grouped_persistent.NAME, grouped_persistent.check, grouped_persistent.forward,
                       grouped_persistent.backward,
                       description="persistent Triton grouped GEMM (sm90+): TMA loads, device tile map, warp-specialised "
                                   "large tiles; weight gradient through device-side TMA descriptors"),
        Implementation(grouped_cudnn.NAME, grouped_cudnn.check, grouped_cudnn.forward, grouped_cudnn.backward,
                       grouped_cudnn.prepare,
                       "cuDNN MoE grouped matmul with device offsets (dgrad/wgrad on cuDNN where it has engines, "
                       "else the Triton kernels); optional: opfuse[cudnn]"),
        Implementation("reference", _always, grouped_reference.reference_forward,
                       grouped_reference.reference_backward, description="loop of matmuls over host group sizes (syncs "
                                                                           "on a GPU)"),
    ],
    "fp8_linear": [
        Implementation("scaled_mm", scaled_mm.check, scaled_mm.forward, scaled_mm.backward,
                       description="torch._scaled_mm FP8 GEMMs (forward, dgrad, wgrad), cached FP8 weights, Triton "
                                   "quantizers"),
        Implementation("reference", _always, fp8_linear_reference.forward, fp8_linear_reference.backward,
                       description="float32 emulation of the FP8 GEMMs (quantize -> dequantize -> matmul)"),
    ],
    "all_gather_linear_fp8": [
        Implementation("p2p_overlap", collective_fp8_p2p.check, collective_fp8_p2p.forward, collective_fp8_p2p.backward,
                       collective_fp8_p2p.prepare,
                       "FP8 bytes pushed over peer memory while torch._scaled_mm GEMMs each arriving shard (one scale "
                       "per tensor); backward as nccl"),
        Implementation("nccl", collective_fp8_nccl.check, collective_fp8_nccl.ag_forward,
                       collective_fp8_nccl.ag_backward,
                       description="NCCL all-gather of FP8 bytes and scales, one FP8 GEMM; backward: x re-gathered "
                                   "under dgrad, dx reduce-scattered under wgrad"),
        Implementation("reference", _always, collective_fp8_reference.ag_forward,
                       collective_fp8_reference.ag_backward,
                       description="all-gather of FP8 bytes, float32 emulation of the GEMMs"),
    ],
    "linear_reduce_scatter_fp8": [
        Implementation("nccl", collective_fp8_nccl.check, collective_fp8_nccl.rs_forward,
                       collective_fp8_nccl.rs_backward,
                       description="FP8 GEMM, NCCL reduce-scatter of the partial sums; backward: dy gathered in FP8"),
        Implementation("reference", _always, collective_fp8_reference.rs_forward,
                       collective_fp8_reference.rs_backward,
                       description="float32 emulation of the GEMMs, torch.distributed reduce-scatter"),
    ],
    "grouped_linear_fp8": [
        Implementation("scaled_grouped_mm", scaled_grouped_mm.check, scaled_grouped_mm.forward,
                       scaled_grouped_mm.backward,
                       description="torch._scaled_grouped_mm (E4M3, per-row scales) with device offsets; wgrad "
                                   "torch._grouped_mm in bfloat16"),
        Implementation("reference", _always, fp8_grouped_reference.forward, fp8_grouped_reference.backward,
                       description="float32 emulation, loop over host group sizes (syncs on a GPU)"),
    ],
    "quantize": [
        Implementation("triton", quantize_triton.check, quantize_triton.forward,
                       description="amax + cast kernels (per tensor) or one pass per row"),
        Implementation("reference", _always, quantize_reference.forward, description="torch ops"),
    ],
}

#: Fused ops whose order also depends on measurements on the running GPU: a pure function
#: ``(spec, implementations in table order) -> implementations in the order to try``.
MEASURED_ORDER: dict[str, Callable[[CallSpec, Sequence[Implementation]], list[Implementation]]] = {
    "grouped_linear": grouped_tuning.order,
}

_BY_NAME = {op: {impl.name: impl for impl in impls} for op, impls in TABLE.items()}


def for_op(op: str, spec: CallSpec | None = None) -> list[Implementation]:
    """``op``'s implementations in the order tried: the table's, or for a call (``spec``) of an op
    in :data:`MEASURED_ORDER`, the measured order of the running GPU and size class."""
    try:
        impls = TABLE[op]
    except KeyError:
        raise ImplementationError(f"no fused op {op!r} in the implementation table; known: {sorted(TABLE)}") from None
    reorder = MEASURED_ORDER.get(op)
    return impls if spec is None or reorder is None else reorder(spec, impls)


def get(op: str, name: str) -> Implementation:
    """Implementation ``name`` of ``op`` (what a custom op runs for the ``impl`` it was given)."""
    try:
        return _BY_NAME[op][name]
    except KeyError:
        known = sorted(_BY_NAME[op]) if op in _BY_NAME else sorted(TABLE)
        raise ImplementationError(f"{op}: no implementation {name!r}; known: {known}") from None


def names() -> dict[str, list[str]]:
    """``{fused op: [implementation names in order]}`` (for ``doctor`` and setting validation)."""
    return {op: [impl.name for impl in impls] for op, impls in TABLE.items()}
