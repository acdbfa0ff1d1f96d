"""``Quantize``: an activation to FP8 in front of a GEMM (inserted by the compiler under
:func:`opfuse.fp8.autocast`; see :mod:`opfuse.core.passes.fp8`)."""

from __future__ import annotations

import torch

from ..fp8.recipe import FP8_DTYPES, Recipe
from ..fp8.tensor import quantize_activation, tag
from . import group as groups
from .base import BasicOp, OpInputError, TensorMeta, check_flag
from .sharding import Sharding, reject_partial

__all__ = ["Quantize"]


class Quantize(BasicOp):
    """``x`` quantized to FP8 along its last dim, as an :class:`opfuse.fp8.Float8Activation`.

    The value keeps ``x``'s shape and (for autograd) dtype; the gradient passes through unchanged
    (the GEMM that consumes the FP8 value quantizes its own backward operands).

    Parameters
    ----------
    dtype:
        ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    rowwise:
        One scale per row (token) instead of one per tensor.
    amax_group:
        A process group whose ranks share one scale (the amax is all-reduced over it): set when
        the quantized shards are all-gathered next, so the gathered tensor has one scale.
    """

    keeps_quantized = True

    def __init__(self, dtype: torch.dtype = torch.float8_e4m3fn, rowwise: bool = False, amax_group=None):
        super().__init__()
        if not isinstance(dtype, torch.dtype) or dtype not in FP8_DTYPES:
            raise ValueError(f"Quantize: dtype={dtype!r}; accepted: torch.float8_e4m3fn, torch.float8_e5m2")
        self.dtype = dtype
        self.rowwise = check_flag(rowwise, "Quantize", "rowwise")
        self.amax_group = amax_group

    @classmethod
    def for_recipe(cls, recipe: Recipe, amax_group=None) -> "Quantize":
        """The forward activation quantizer of ``recipe`` (E4M3; per row or per tensor)."""
        return cls(recipe.forward_dtype, recipe.rowwise, None if recipe.rowwise else amax_group)

    @property
    def tag(self) -> str:
        return tag(self.dtype, self.rowwise)

    def extra_repr(self) -> str:
        text = f"{self.tag.split('/')[0]}, scale per {'row' if self.rowwise else 'tensor'}"
        if self.amax_group is not None:
            text += f", amax over group={groups.group_name(self.amax_group)}"
        return text

    def forward(self, x):
        group = None
        if self.amax_group is not None and groups.world_size(self.amax_group) > 1:
            group = groups.resolve(self.amax_group)
        return quantize_activation(x, self.dtype, self.rowwise, group)

    def propagate_sharding(self, x: Sharding, *extra) -> Sharding:
        """Per row (or per local tensor): any token or feature layout; not a partial sum (its
        scale would not be the sum's)."""
        reject_partial(self, x)
        return x

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        self._require_float(x)
        if len(x.shape) < 1:
            raise OpInputError(f"{self.describe()}: input must have at least 1 dim, got a scalar")
        return x.with_(quantized=self.tag)
