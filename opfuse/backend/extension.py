"""Building and loading the CUDA extension (placeholder until the kernels land)."""


def status() -> str:
    return "not built (no kernels yet)"
