"""Normalisation ops over the last dim: :class:`RMSNorm` and :class:`LayerNorm`.

Statistics are computed in at least float32 (float64 inputs stay float64), what the fused kernels
do too, and the result is cast back to the input dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .base import BasicOp, PartitionError, TensorMeta, check_flag, check_size
from .sharding import Sharding, reject_partial

__all__ = ["RMSNorm", "LayerNorm", "ExtraOutputNorm", "rms_norm_reference", "layer_norm_reference", "norm_backward",
           "compute_dtype"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are computed in: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` with float32 (or wider) statistics."""
    ct = compute_dtype(x.dtype)
    xf = x.to(ct)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(ct)
    return y.to(x.dtype)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                         eps: float) -> torch.Tensor:
    ct = compute_dtype(x.dtype)
    y = F.layer_norm(x.to(ct), (x.shape[-1],), None if weight is None else weight.to(ct),
                     None if bias is None else bias.to(ct), eps)
    return y.to(x.dtype)


def norm_backward(dy, h, dh_out, weight, bias, eps: float, kind: str):
    """Gradients of ``y = norm(h)`` (``kind`` ``"rms"`` or ``"layer"``), in closed form with
    float32 (or wider) arithmetic: ``(dh, dweight, dbias)``, the last two empty when absent.

    ``dh_out`` is the gradient reaching ``h`` from its other use (e.g. the residual that
    ``MakeExtraOutput`` exports); it is added before ``dh`` is rounded to ``h``'s dtype, so the
    sum is rounded once. ``dy`` may be ``None`` (only ``dh_out`` flows back)."""
    ct = compute_dtype(h.dtype)
    hidden = h.shape[-1]
    hf = h.to(ct).reshape(-1, hidden)
    if dy is None:
        dyf = hf.new_zeros(hf.shape)
    else:
        dyf = dy.to(ct).reshape(-1, hidden)
    g = dyf * weight.to(ct) if weight is not None else dyf
    if kind == "rms":
        rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        xhat = hf * rstd
        dh = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    elif kind == "layer":
        mean = hf.mean(-1, keepdim=True)
        rstd = torch.rsqrt((hf - mean).pow(2).mean(-1, keepdim=True) + eps)
        xhat = (hf - mean) * rstd
        dh = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    else:
        raise ValueError(f"norm backward: kind={kind!r}; accepted: 'rms', 'layer'")
    if dh_out is not None:
        dh = dh + dh_out.to(ct).reshape(dh.shape)
    dw = (dyf * xhat).sum(0).to(weight.dtype) if weight is not None else h.new_empty(0)
    db = dyf.sum(0).to(bias.dtype) if bias is not None else h.new_empty(0)
    return dh.to(h.dtype).reshape(h.shape), dw, db


class _Norm(BasicOp):
    def __init__(self, normalized_shape: int, eps: float, elementwise_affine: bool, device, dtype):
        super().__init__()
        if isinstance(normalized_shape, (tuple, list)):
            if len(normalized_shape) != 1:
                raise ValueError(
                    f"{type(self).__name__}: normalized_shape={normalized_shape!r}; only the last "
                    f"dim can be normalised (pass an int)"
                )
            normalized_shape = normalized_shape[0]
        who = type(self).__name__
        normalized_shape = check_size(normalized_shape, who, "normalized_shape")
        # eps = 0 is accepted as torch.nn.RMSNorm/LayerNorm accept it (and as traced models hold it): an
        # all-zero (RMSNorm) or constant (LayerNorm) row then gives NaN there as here. inf, NaN and True are not
        # an eps.
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
            raise ValueError(f"{who}: eps={eps!r}; expected a finite float >= 0 (e.g. 1e-6)")
        self.hidden_size = normalized_shape
        self.eps = float(eps)
        self.elementwise_affine = check_flag(elementwise_affine, who, "elementwise_affine")
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps:g}"

    def propagate_sharding(self, x: Sharding, *extra) -> Sharding:
        """Per token: any token layout; the statistics need every feature, reduced."""
        if x.features:
            raise PartitionError(
                f"{self.describe()}: its input is sharded on features (the output of a column-parallel Linear); "
                f"a norm needs the full hidden dim")
        reject_partial(self, x)
        return x

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        self._require_float(x)
        self._require_features(x, self.hidden_size)
        # Parameters may be wider than the activations (float32 norm weights with bf16 activations
        # are common); the result keeps the activation dtype.
        self._require_param_match(x, list(self.parameters()), check_dtype=False)
        return x.with_(requires_grad=x.requires_grad or any(p.requires_grad for p in self.parameters()))


class RMSNorm(_Norm):
    """Root-mean-square normalisation over the last dim: ``x / rms(x) * weight``."""

    def __init__(self, normalized_shape: int, eps: float = 1e-6, elementwise_affine: bool = True,
                 device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)

    def forward(self, x):
        return rms_norm_reference(x, self.weight, self.eps)


class LayerNorm(_Norm):
    """Layer normalisation over the last dim (mean and variance, then ``* weight + bias``)."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        check_flag(bias, "LayerNorm", "bias")
        if elementwise_affine and bias:
            self.bias = nn.Parameter(torch.zeros(self.hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        return layer_norm_reference(x, self.weight, self.bias, self.eps)


class _NormKeepingInput(torch.autograd.Function):
    """``(norm(x), x)`` with one backward for both uses of ``x`` (see :class:`ExtraOutputNorm`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, kind):
        y = rms_norm_reference(x, weight, eps) if kind == "rms" else layer_norm_reference(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias)
        ctx.eps, ctx.kind = eps, kind
        ctx.set_materialize_grads(False)
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, dy, dx_out):
        x, weight, bias = ctx.saved_tensors
        if dy is None and dx_out is None:
            return None, None, None, None, None
        dx, dw, db = norm_backward(dy, x, dx_out, weight, bias, ctx.eps, ctx.kind)
        return (dx, dw if weight is not None and dy is not None else None,
                db if bias is not None and dy is not None else None, None, None)


class ExtraOutputNorm(BasicOp):
    """``MakeExtraOutput -> RMSNorm/LayerNorm`` as one op: returns ``(norm(x), x)``.

    The gradient reaching ``x`` from the norm and from the extra output is summed in float32 and
    rounded once (autograd would round the norm's input gradient to bfloat16/float16 before adding
    the other: nearly cancelling terms lose their digits). Programs use it where no fusion rule
    took the pair; it shares ``norm``'s parameters.
    """

    num_extra_outputs = 1

    def __init__(self, norm: _Norm):
        super().__init__()
        self.norm = norm
        self.kind_name = "rms" if isinstance(norm, RMSNorm) else "layer"

    def extra_repr(self) -> str:
        return self.norm.describe()

    def forward(self, x):
        return _NormKeepingInput.apply(x, self.norm.weight, getattr(self.norm, "bias", None), self.norm.eps,
                                       self.kind_name)

    def propagate_sharding(self, x: Sharding, *extra) -> Sharding:
        return self.norm.propagate_sharding(x)

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        return self.norm.infer_meta(x)
