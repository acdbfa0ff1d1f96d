"""FlashInfer's fused all-reduce + residual + RMSNorm, bound for the benchmarks (never used by opfuse)."""
