"""Fused-op implementations, the dispatch table, the symmetric-memory pool, and the CUDA extension."""
