"""The FP8 variants of the collective GEMMs, ``all_gather_linear_fp8`` and ``linear_reduce_scatter_fp8``:
the fused ops (:mod:`.op`), their float32 emulation (:mod:`.reference`), NCCL with FP8 bytes
(:mod:`.nccl`), the peer-memory push of FP8 bytes (:mod:`.p2p`) and what they share (:mod:`.common`).
"""
