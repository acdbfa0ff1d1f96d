"""Reference implementation of the residual-norm family: torch ops and ``torch.distributed``,
exactly the unfused chain of basic ops, on any device and dtype."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from ...ops import group as groups
from ...ops.collectives import raw_all_reduce
from ...ops.norm import layer_norm_reference, norm_backward, rms_norm_reference
from ..quantize import reference as quantize_reference

__all__ = ["NORMS", "apply_norm", "forward", "backward", "forward_quantize", "allreduce_then"]

#: Norm kinds of the family: RMSNorm, LayerNorm, or none (a plain all-reduce).
NORMS = ("rms", "layer", "none")


def apply_norm(h: Tensor, weight: Optional[Tensor], norm_bias: Optional[Tensor], norm: str, eps: float) -> Tensor:
    if norm == "rms":
        return rms_norm_reference(h, weight, eps)
    if norm == "layer":
        return layer_norm_reference(h, weight, norm_bias, eps)
    raise ValueError(f"residual_norm: norm={norm!r}; accepted: {NORMS}")


def forward(x, bias, residual, weight, norm_bias, eps, group, write_residual, *, norm):
    """``h = sum_ranks(x) [+ bias] [+ residual]`` (no sum when ``group`` is empty), ``y = norm(h)``;
    returns ``(y, h)`` with ``h`` empty unless ``write_residual``."""
    h = raw_all_reduce(x, groups.from_name(group)) if group else x
    if bias is not None:
        h = h + bias
    if residual is not None:
        h = h + residual
    if norm == "none":
        return (h.clone() if h is x else h), x.new_empty(0)
    y = apply_norm(h, weight, norm_bias, norm, eps)
    if not write_residual:
        return y, x.new_empty(0)
    return y, (h.clone() if h is x or h is residual else h)


def forward_quantize(x, bias, residual, weight, norm_bias, eps, write_residual, dtype, rowwise, amax_group, *, norm):
    """:func:`forward` (no all-reduce), then ``y`` quantized to FP8: ``(Float8Activation, h)``."""
    y, h = forward(x, bias, residual, weight, norm_bias, eps, "", write_residual, norm=norm)
    return quantize_reference.forward(y, dtype, rowwise, amax_group), h


def allreduce_then(local_quantize):
    """The forward of ``allreduce_add_*norm_quantize`` composed from a torch.distributed all-reduce
    (NCCL, gloo) and ``local_quantize``, a forward of ``add_*norm_quantize`` (the same arguments
    without ``group``)."""

    def forward(x, bias, residual, weight, norm_bias, eps, group, write_residual, dtype, rowwise, amax_group):
        summed = raw_all_reduce(x, groups.from_name(group))
        return local_quantize(summed, bias, residual, weight, norm_bias, eps, write_residual, dtype, rowwise,
                              amax_group)

    return forward


def backward(dy, h, dh_out, weight, norm_bias, eps, *, norm):
    """Gradient of ``y = norm(h)`` plus ``dh_out`` (the gradient reaching ``h`` from its other use),
    summed in float32 and rounded once (closed form; custom ops run without autograd):
    ``(dh, dweight, dnorm_bias)``, the latter two empty when absent."""
    if norm not in ("rms", "layer"):
        raise ValueError(f"residual_norm backward: norm={norm!r}; accepted: 'rms', 'layer'")
    return norm_backward(dy, h, dh_out, weight, norm_bias, eps, norm)
