"""The dispatch table, written out: for each fused op, its implementations in the order tried.

Registration is this list, not a side effect of imports. Capability checks run when a program is
compiled; the first implementation whose check passes is used and recorded in ``Program.fusions``.
"""

from __future__ import annotations

from . import cuda, grouped, overlap
from .dispatch import Implementation
from .fused import linear_activation, linear_comm, residual_norm

__all__ = ["builtin_table"]


def _always(spec) -> None:
    return None


def builtin_table() -> dict[str, list[Implementation]]:
    reference_norm = Implementation(
        "reference", _always, residual_norm.reference_forward, residual_norm.reference_backward,
        "torch.distributed all-reduce, then torch add and norm (float32 statistics)")
    return {
        "allreduce_add_norm": cuda.residual_norm_implementations("allreduce_add_norm") + [reference_norm],
        "add_norm": cuda.residual_norm_implementations("add_norm") + [reference_norm],
        "allreduce": cuda.residual_norm_implementations("allreduce") + [reference_norm],
        "all_gather_linear": overlap.all_gather_linear_implementations() + [
            Implementation("reference", _always, linear_comm.ag_linear_reference,
                           linear_comm.ag_linear_backward_reference, "all-gather, then one GEMM"),
        ],
        "linear_reduce_scatter": overlap.linear_reduce_scatter_implementations() + [
            Implementation("reference", _always, linear_comm.linear_rs_reference,
                           linear_comm.linear_rs_backward_reference, "one GEMM, then reduce-scatter"),
        ],
        "linear_bias_activation": [
            Implementation("cublaslt_epilogue", linear_activation.cublaslt_check, linear_activation.cublaslt_forward,
                           linear_activation.reference_backward, "cuBLASLt GEMM with bias+GELU(tanh) epilogue"),
            Implementation("reference", _always, linear_activation.reference_forward,
                           linear_activation.reference_backward, "addmm, then gelu"),
        ],
        "grouped_linear": grouped.implementations(),
    }
