"""Custom ops that carry an FP8 activation as two plain tensors, for compiled graphs.

In an ``ops.Sequential`` program an FP8 activation travels between fused ops as one
:class:`~opfuse.fp8.Float8Activation` (a tensor subclass autograd sees as the activation). A graph
Inductor compiles holds plain tensors only, so there the activation is its payload: ``data`` (FP8
bytes, the activation's shape) and ``scale`` (float32 ``[1, 1]`` or ``[rows, 1]``). These ops run
the very implementations the fused ops chose (``opfuse.core.dispatch``), unwrapping the payload the
producers return and handing it to the GEMMs:

=============================================  ============================================================
op                                             computes
=============================================  ============================================================
``compiled_quantize(x, ...)``                  ``(data, scale)`` of the ``quantize`` fused op
``compiled_norm_quantize(op, x, ...)``         ``(data, scale, h)`` of ``add_rmsnorm_quantize``,
                                               ``add_layernorm_quantize``, ``allreduce_add_rmsnorm_quantize``
``compiled_fp8_gemm(op, data, scale, ...)``    ``y`` of ``fp8_linear``, ``all_gather_linear_fp8``,
                                               ``linear_reduce_scatter_fp8`` for an input that came quantized
``compiled_fp8_gemm_quantizing(op, x, ...)``   ``(y, x_data, x_scale, x_data_t)`` of the same ops for a
                                               high-precision ``x`` they quantize themselves
=============================================  ============================================================

Whether a GEMM also writes ``x``'s transposed FP8 bytes for the weight gradient (``x_data_t``) is
an argument here (``want_t``), decided when the graph is built: the fused ops decide it from
``weight.requires_grad``, which a compiled graph's inputs do not carry the same way at trace time
and at run time, and an output's shape must be what the graph was traced with.

The backward GEMMs take plain tensors already (``opfuse::fp8_linear_backward`` and its collective
twins): the graph calls them directly. None of these ops is differentiable: they appear in graphs
AOTAutograd has already differentiated (see :mod:`.fp8_lower`), and each has a ``direct``
overload the graph pass points those calls at (:func:`opfuse.machinery.fused_op.graph_op`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..core import dispatch as implementations
from ..fp8.state import weights_trained
from ..fp8.tensor import Float8Activation
from ..machinery.fused_op import graph_op
from ..ops import group as groups

__all__ = ["NORM_QUANTIZE_OPS", "FP8_GEMM_OPS", "compiled_quantize", "compiled_norm_quantize", "compiled_fp8_gemm",
           "compiled_fp8_gemm_quantizing"]

#: Norms that emit FP8: ``name -> whether an all-reduce comes first``.
NORM_QUANTIZE_OPS = {"add_rmsnorm_quantize": False, "add_layernorm_quantize": False,
                     "allreduce_add_rmsnorm_quantize": True}
#: FP8 GEMMs: ``name -> rows of y per row of x`` (+1 gathered over the group, -1 scattered, 0 local).
FP8_GEMM_OPS = {"fp8_linear": 0, "all_gather_linear_fp8": 1, "linear_reduce_scatter_fp8": -1}


def _payload(y) -> tuple[Tensor, Tensor]:
    if not isinstance(y, Float8Activation):
        raise TypeError(f"opfuse: an FP8 producer returned {type(y).__name__}, expected a Float8Activation")
    return y._data, y._scale_inv


def _scale_fake(x: Tensor, rowwise: bool) -> Tensor:
    rows = x.reshape(-1, x.shape[-1]).shape[0] if x.dim() else 1
    return x.new_empty((rows if rowwise else 1, 1), dtype=torch.float32)


_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _quantize_fake(x, dtype, rowwise, amax_group, impl):
    return x.new_empty(x.shape, dtype=_FP8[dtype]), _scale_fake(x, rowwise)


@graph_op("opfuse::compiled_quantize", _quantize_fake)
def compiled_quantize(x: Tensor, dtype: str, rowwise: bool, amax_group: str, impl: str) -> tuple[Tensor, Tensor]:
    """``(data, scale)`` of ``x`` quantized by the ``quantize`` fused op's implementation ``impl``."""
    return _payload(implementations.get("quantize", impl).forward(x, dtype, rowwise, amax_group))


def _norm_quantize_fake(op, x, bias, residual, weight, norm_bias, eps, group, write_residual, dtype, rowwise,
                        amax_group, impl):
    h = torch.empty_like(x) if write_residual else x.new_empty(0)
    return x.new_empty(x.shape, dtype=_FP8[dtype]), _scale_fake(x, rowwise), h


@graph_op("opfuse::compiled_norm_quantize", _norm_quantize_fake)
def compiled_norm_quantize(op: str, x: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
                           weight: Optional[Tensor], norm_bias: Optional[Tensor], eps: float, group: str,
                           write_residual: bool, dtype: str, rowwise: bool, amax_group: str,
                           impl: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(data, scale, h)`` of norm-emitting-FP8 fused op ``op`` (:data:`NORM_QUANTIZE_OPS`)."""
    forward = implementations.get(op, impl).forward
    reduce = (group,) if NORM_QUANTIZE_OPS[op] else ()
    y, h = forward(x, bias, residual, weight, norm_bias, eps, *reduce, write_residual, dtype, rowwise, amax_group)
    data, scale = _payload(y)
    return data, scale, h


def _stub(data: Tensor, dtype: torch.dtype) -> Tensor:
    """A tensor of ``data``'s shape and ``dtype`` without memory of its own (the GEMMs read only the
    shape and dtype of an input that came quantized)."""
    return torch.empty((), dtype=dtype, device=data.device).expand(data.shape)


def _rows_out(op: str, rows: int, group: str) -> int:
    factor = FP8_GEMM_OPS[op]
    if factor:
        world = groups.world_size(groups.from_name(group))
        rows = rows * world if factor > 0 else rows // world
    return rows


def _gemm_fake(op, data, scale, weight, bias, group, out_dtype, recipe, impl):
    rows = _rows_out(op, data.shape[0], group)
    return data.new_empty((rows,) + tuple(data.shape[1:-1]) + (weight.shape[0],), dtype=out_dtype)


@graph_op("opfuse::compiled_fp8_gemm", _gemm_fake)
def compiled_fp8_gemm(op: str, data: Tensor, scale: Tensor, weight: Tensor, bias: Optional[Tensor], group: str,
                      out_dtype: torch.dtype, recipe: str, impl: str) -> Tensor:
    """``y`` of FP8 GEMM fused op ``op`` (:data:`FP8_GEMM_OPS`) for an input quantized upstream."""
    forward = implementations.get(op, impl).forward
    collective = (group,) if FP8_GEMM_OPS[op] else ()
    y, *_ = forward(_stub(data, out_dtype), data, scale, weight, bias, *collective, recipe)
    return y


def _gemm_quantizing_fake(op, x, weight, bias, group, recipe, want_t, impl):
    rows = x.shape[0]
    rowwise = recipe.startswith("row")
    y = x.new_empty((_rows_out(op, rows, group), weight.shape[0]))
    data_t = x.new_empty((x.shape[1], rows) if want_t else (0,), dtype=torch.float8_e4m3fn)
    return y, x.new_empty(x.shape, dtype=torch.float8_e4m3fn), _scale_fake(x, rowwise), data_t


@graph_op("opfuse::compiled_fp8_gemm_quantizing", _gemm_quantizing_fake)
def compiled_fp8_gemm_quantizing(op: str, x: Tensor, weight: Tensor, bias: Optional[Tensor], group: str, recipe: str,
                                 want_t: bool, impl: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(y, x_data, x_scale, x_data_t)`` of FP8 GEMM fused op ``op`` quantizing its 2-D input ``x``
    (``x_data_t``: the transposed bytes when ``want_t`` and the implementation writes them, else
    empty)."""
    forward = implementations.get(op, impl).forward
    collective = (group,) if FP8_GEMM_OPS[op] else ()
    # The fused ops write the transposed bytes for a trained weight: say which here, on the
    # parameter itself (its cached FP8 copies then serve this call and the backward's).
    with weights_trained(want_t):
        y, data, scale, data_t = forward(x, None, None, weight, bias, *collective, recipe)
    if not want_t and data_t.numel():
        data_t = data_t.new_empty(0)
    return y, data, scale, data_t
