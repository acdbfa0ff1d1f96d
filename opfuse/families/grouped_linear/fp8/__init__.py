"""The FP8 grouped GEMM of ``GroupedLinear`` (mixture of experts), ``grouped_linear_fp8``: the fused op
(:mod:`.op`), its float32 emulation (:mod:`.reference`) and ``torch._scaled_grouped_mm``
(:mod:`.scaled_grouped_mm`, sm90). FSDP weight shards are quantized where they live and all-gathered
as FP8 bytes plus per-row scales (:mod:`.common`)."""
