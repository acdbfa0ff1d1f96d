"""Normalisation ops over the last dim: :class:`RMSNorm` and :class:`LayerNorm`.

Statistics are computed in at least float32 (float64 inputs stay float64), what the fused kernels
do too, and the result is cast back to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import BasicOp, PartitionError, TensorMeta
from .sharding import Sharding, reject_partial

__all__ = ["RMSNorm", "LayerNorm", "rms_norm_reference", "layer_norm_reference", "compute_dtype"]


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
        if not isinstance(normalized_shape, int) or normalized_shape <= 0:
            raise ValueError(f"{type(self).__name__}: normalized_shape={normalized_shape!r}; expected a positive int")
        if not (isinstance(eps, (int, float)) and eps >= 0):
            raise ValueError(f"{type(self).__name__}: eps={eps!r}; expected a float >= 0")
        self.hidden_size = normalized_shape
        self.eps = float(eps)
        self.elementwise_affine = elementwise_affine
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
        if elementwise_affine and bias:
            self.bias = nn.Parameter(torch.zeros(self.hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        return layer_norm_reference(x, self.weight, self.bias, self.eps)

