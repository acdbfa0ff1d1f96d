"""Comm + GEMM overlap implementations of ``all_gather_linear`` and ``linear_reduce_scatter``:
chunked peer-to-peer pipelines over the symmetric pool (issue 5).

Modules, in the order a call goes through them:

* :mod:`.policy`   sub-chunk grids, signal channels, region sizes (pure Python);
* :mod:`.plan`     the instruction set of per-rank plans and its synchronisation rules;
* :mod:`.schedules` the schedules (gather, ring, direct) as plan builders (pure Python);
* :mod:`.simulate` a CPU interpreter of plans (all ranks/streams, random interleavings) used by
  the tests to check the schedules without GPUs;
* :mod:`.resources` pool/region lookup and caching; :mod:`.executor` compiles a plan into
  straight-line Python and runs it on CUDA;
* :mod:`.impl`     forward/backward/check functions registered below;
* :mod:`.hostcost` the host (Python) cost per call of the bench cases, measured on CPU.
"""

from __future__ import annotations

from ..dispatch import Implementation

__all__ = ["all_gather_linear_implementations", "linear_reduce_scatter_implementations"]


def all_gather_linear_implementations() -> list[Implementation]:
    """Implementations tried before the reference, in order."""
    from . import impl

    return [Implementation(
        impl.NAME, impl.check_all_gather_linear, impl.all_gather_linear_forward, impl.all_gather_linear_backward,
        "token all-gather pushed over peer memory (copy engine) while cuBLAS GEMMs each arrived shard; "
        "backward: dgrad ring reduce-scatter + input re-gather for wgrad")]


def linear_reduce_scatter_implementations() -> list[Implementation]:
    """Implementations tried before the reference, in order."""
    from . import impl

    return [Implementation(
        impl.NAME, impl.check_linear_reduce_scatter, impl.linear_reduce_scatter_forward,
        impl.linear_reduce_scatter_backward,
        "ring of GEMM sub-chunks whose partial sums are pushed over peer memory and accumulated in the next "
        "rank's GEMM epilogue; backward: dy all-gather overlapped with dgrad")]
