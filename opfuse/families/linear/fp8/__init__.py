"""The FP8 linear GEMM, ``fp8_linear``: ``[Quantize ->] BasicLinear(fp8) [-> Bias]`` as one fused op
(:mod:`.op`), its float32 emulation (:mod:`.reference`, the CPU implementation) and
``torch._scaled_mm`` (:mod:`.scaled_mm`, sm89+).
"""
