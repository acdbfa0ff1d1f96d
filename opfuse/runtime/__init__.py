"""What every fused-op family runs on: the CUDA extension builds, the symmetric-memory pool, and
per-device facts. Imports nothing from the families."""
