"""Reference implementation of the ``quantize`` fused op: :mod:`opfuse.fp8.numerics` in torch ops,
the shared amax all-reduced with ``torch.distributed``."""

from __future__ import annotations

import torch
from torch.distributed import distributed_c10d as c10d

from ...fp8 import numerics
from ...fp8.recipe import E4M3, E5M2
from ...fp8.tensor import Float8Activation

__all__ = ["DTYPES", "forward", "quantize_with", "share_amax", "tensor_amax"]

#: The ``dtype`` argument of the fused op.
DTYPES = {"e4m3": E4M3, "e5m2": E5M2}


def share_amax(amax: torch.Tensor, amax_group: str) -> torch.Tensor:
    """``amax`` all-reduced (max, in place) over the ranks of ``amax_group`` (a group name; empty:
    none), so that the shards those ranks gather next share one scale."""
    if amax_group and c10d._get_group_size_by_name(amax_group) > 1:
        # The functional collective is one C++ call: torch.distributed.all_reduce's Python layers
        # cost far more host time than this 4-byte all-reduce takes on the GPU (docs/PERF_NOTES.md,
        # "Triton launches"), once per FP8 activation gathered under sequence parallelism.
        torch.ops._c10d_functional.all_reduce_(amax, "max", amax_group)
        torch.ops._c10d_functional.wait_tensor(amax)
    return amax


def tensor_amax(row_amax: torch.Tensor, amax_group: str) -> torch.Tensor:
    """A tensor's amax (float32 ``[1, 1]``) from its rows' amaxes (float32 ``[rows]``; none: 0),
    shared over ``amax_group`` (:func:`share_amax`)."""
    if row_amax.numel():
        amax = row_amax.amax().reshape(1, 1)
    else:
        amax = torch.zeros((1, 1), dtype=torch.float32, device=row_amax.device)
    return share_amax(amax, amax_group)


def quantize_with(quantizer, amax_fn, x: torch.Tensor, dtype: str, rowwise: bool, amax_group: str) -> Float8Activation:
    """Quantize ``x`` along its last dim with ``quantizer(rows, dtype, rowwise, amax_value=)``; with
    ``amax_group`` (one scale per tensor) the amax from ``amax_fn(rows)`` is all-reduced first."""
    fp8 = DTYPES[dtype]
    rows = x.reshape(-1, x.shape[-1])
    amax_value = None
    if amax_group and not rowwise:
        amax_value = share_amax(amax_fn(rows), amax_group)
    q = quantizer(rows, fp8, rowwise, amax_value=amax_value)
    return Float8Activation(q.data.reshape(x.shape), q.scale_inv, x.dtype)


def forward(x, dtype, rowwise, amax_group):
    return quantize_with(numerics.quantize, lambda rows: numerics.amax(rows, False), x, dtype, rowwise, amax_group)
