"""The collective-linear family's implementations, per fused op in the order they are tried: the
peer-to-peer overlap pipelines, cuBLASMp (optional), then the reference (the collective, then one
GEMM); for the FP8 variants the peer-memory push and NCCL, then the float32 emulation."""

from __future__ import annotations

from ...machinery.implementation import Implementation, ImplementationTable, always
from . import cublasmp as collective_cublasmp
from . import p2p as collective_p2p
from . import reference as collective_reference
from .fp8 import nccl as collective_fp8_nccl
from .fp8 import p2p as collective_fp8_p2p
from .fp8 import reference as collective_fp8_reference

__all__ = ["TABLE"]

TABLE = ImplementationTable("collective_linear", {
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
        Implementation("reference", always, collective_reference.ag_linear_forward,
                       collective_reference.ag_linear_backward, description="all-gather, then one GEMM"),
    ],
    "all_gather_linear_keep": [
        Implementation(collective_p2p.NAME, collective_p2p.check_all_gather_linear_keep,
                       collective_p2p.all_gather_linear_keep_forward, None, collective_p2p.prepare,
                       "all_gather_linear's overlap (copy-engine pushes, a GEMM per arrived shard) with the own "
                       "shard in the gathered region, which is copied out for the other readers; forward only"),
        Implementation("reference", always, collective_reference.ag_linear_keep_forward,
                       description="all-gather, then one GEMM; the gathered tensor returned too"),
    ],
    "all_gather_tokens": [
        Implementation(collective_p2p.NAME, collective_p2p.check_all_gather_tokens,
                       collective_p2p.all_gather_tokens_forward, None, collective_p2p.prepare,
                       "every shard pushed over peer memory by the copy engines (no SMs), the gathered region "
                       "copied out; forward only"),
        Implementation("reference", always, collective_reference.all_gather_tokens_forward,
                       description="torch.distributed all-gather (NCCL) in line"),
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
        Implementation("reference", always, collective_reference.linear_rs_forward,
                       collective_reference.linear_rs_backward, description="one GEMM, then reduce-scatter"),
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
        Implementation("reference", always, collective_fp8_reference.ag_forward,
                       collective_fp8_reference.ag_backward,
                       description="all-gather of FP8 bytes, float32 emulation of the GEMMs"),
    ],
    "linear_reduce_scatter_fp8": [
        # p2p_overlap first: faster than nccl in the FP8 train-sp step under CUDA graphs in both A/B runs so
        # far (docs/PERF_NOTES.fp8.md), as the bfloat16 reduce-scatter's is; nccl where it cannot run.
        Implementation("p2p_overlap", collective_fp8_p2p.rs_check, collective_fp8_p2p.rs_forward,
                       collective_fp8_p2p.rs_backward, collective_fp8_p2p.rs_prepare,
                       "the bfloat16 reduce-scatter plans with torch._scaled_mm GEMM chunks: partial sums pushed "
                       "over peer memory while the next chunk multiplies (one scale per tensor); backward: FP8 dy "
                       "pushed to the peers under the dgrad GEMMs, kept for the FP8 wgrad"),
        Implementation("nccl", collective_fp8_nccl.check, collective_fp8_nccl.rs_forward,
                       collective_fp8_nccl.rs_backward,
                       description="FP8 GEMM, NCCL reduce-scatter of the partial sums; backward: dy gathered in FP8"),
        Implementation("reference", always, collective_fp8_reference.rs_forward,
                       collective_fp8_reference.rs_backward,
                       description="float32 emulation of the GEMMs, torch.distributed reduce-scatter"),
    ],
})
