"""GEMM + bias + activation as one fused op (``linear_bias_activation``)."""
