"""Comm + GEMM overlap implementations of ``all_gather_linear`` and ``linear_reduce_scatter``
(chunked peer-to-peer pipelines over the symmetric pool). Filled in by issue 5."""

from __future__ import annotations

from ..dispatch import Implementation


def all_gather_linear_implementations() -> list[Implementation]:
    """Implementations tried before the reference, in order."""
    return []


def linear_reduce_scatter_implementations() -> list[Implementation]:
    """Implementations tried before the reference, in order."""
    return []
