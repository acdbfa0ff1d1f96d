"""FP8 recipes: how a block's GEMM operands are scaled and in which FP8 formats.

A recipe is a small frozen value (hashable: it is part of a compiled program's cache key). Both
recipes use *current scaling*: each tensor's scale comes from the absolute maximum (amax) of that
tensor at the moment it is quantized, so nothing is carried from step to step.

=====================  ====================================================================
recipe                 scales
=====================  ====================================================================
``TensorScaling()``    one float32 scale per tensor (per weight shard, per expert's weight)
``RowwiseScaling()``   one per row of the activations (per token) and one per output channel
                       of the weights; each GEMM operand is scaled along its contracting dim
=====================  ====================================================================

Activations and weights are quantized to E4M3 (``torch.float8_e4m3fn``: 3 mantissa bits, max
448); gradients to ``grad_dtype`` (E5M2 = ``torch.float8_e5m2``: 2 mantissa bits, max 57344, the
range gradients need; or E4M3). ``fp8_wgrad=False`` keeps the weight-gradient GEMM in the
parameter dtype (the most precision-sensitive of the three GEMMs).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import torch

__all__ = ["Recipe", "TensorScaling", "RowwiseScaling", "E4M3", "E5M2", "FP8_DTYPES", "recipe_from_key"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
#: The FP8 formats and their largest finite value.
FP8_DTYPES = {E4M3: 448.0, E5M2: 57344.0}
_SHORT = {E4M3: "e4m3", E5M2: "e5m2"}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Base class of the FP8 recipes (use :class:`TensorScaling` or :class:`RowwiseScaling`)."""

    #: ``"tensor"`` or ``"row"``: what one scale covers.
    granularity: ClassVar[str] = ""
    #: The format of gradients (the GEMM inputs of backward): E5M2 or E4M3.
    grad_dtype: torch.dtype = E5M2
    #: Run the weight-gradient GEMM in FP8 (else in the parameter dtype).
    fp8_wgrad: bool = True
    #: Round each weight's (each expert's) scale down to a power of two (:class:`TensorScaling` only).
    pow2_weight_scales: bool = False

    def __post_init__(self):
        if type(self) is Recipe:
            raise TypeError("opfuse.fp8.Recipe is a base class; use opfuse.fp8.TensorScaling() or RowwiseScaling()")
        if not isinstance(self.grad_dtype, torch.dtype) or self.grad_dtype not in FP8_DTYPES:
            raise ValueError(f"{type(self).__name__}: grad_dtype={self.grad_dtype!r}; accepted: torch.float8_e5m2, "
                             f"torch.float8_e4m3fn")
        if not isinstance(self.fp8_wgrad, bool):
            raise ValueError(f"{type(self).__name__}: fp8_wgrad={self.fp8_wgrad!r}; expected True or False")
        if not isinstance(self.pow2_weight_scales, bool):
            raise ValueError(f"{type(self).__name__}: pow2_weight_scales={self.pow2_weight_scales!r}; expected True "
                             f"or False")
        if self.pow2_weight_scales and self.granularity != "tensor":
            raise ValueError(f"{type(self).__name__}: pow2_weight_scales=True; accepted with TensorScaling only (one "
                             f"scale per weight)")

    @property
    def forward_dtype(self) -> torch.dtype:
        """The format of activations and weights: E4M3."""
        return E4M3

    @property
    def rowwise(self) -> bool:
        return self.granularity == "row"

    def key(self) -> str:
        """A short string naming this recipe (custom ops carry it; :func:`recipe_from_key`
        inverts it), e.g. ``"tensor/e4m3/e5m2/wgrad-fp8"``."""
        wgrad = "fp8" if self.fp8_wgrad else "hp"
        key = f"{self.granularity}/{_SHORT[self.forward_dtype]}/{_SHORT[self.grad_dtype]}/wgrad-{wgrad}"
        return key + ("/w-pow2" if self.pow2_weight_scales else "")

    def describe(self) -> str:
        return (f"{type(self).__name__}(grad={_SHORT[self.grad_dtype]}" + ("" if self.fp8_wgrad else ", wgrad=hp")
                + (", pow2 weight scales" if self.pow2_weight_scales else "") + ")")


@dataclasses.dataclass(frozen=True)
class TensorScaling(Recipe):
    """One scale per tensor, from its current amax; gradients in E5M2 by default.

    ``pow2_weight_scales=True`` rounds each weight's scale ``fp8_max / amax`` down to a power of
    two (each expert's, for MoE expert weights; activations and gradients keep exact scales). The
    quantized weight then depends on its amax only through the amax's exponent, so a weight is
    quantized in one read: with the exponent of its previous step, checked against the amax
    that the same pass computes, and done again only when the exponent moved (rare: a weight's
    amax drifts slowly). The results equal a two-pass quantization with the same scales bit
    for bit; the cost is up to one bit of the FP8 range left unused by the weights.

    Examples
    --------
    >>> with opfuse.fp8.autocast(recipe=opfuse.fp8.TensorScaling()):   # doctest: +SKIP
    ...     y = block(x)
    """

    granularity: ClassVar[str] = "tensor"


@dataclasses.dataclass(frozen=True)
class RowwiseScaling(Recipe):
    """One scale per row of every GEMM operand along its contracting dim (per token for
    activations, per output channel for weights); gradients in E4M3 by default.

    Finer scales follow outliers better than one per tensor. The weight-gradient GEMM stays in
    high precision by default (``fp8_wgrad=False``): its operands contract over the tokens, so in
    FP8 they would have to be quantized again along that dim (from the dequantized forward
    operands), two roundings for the GEMM that tolerates them least.
    """

    granularity: ClassVar[str] = "row"
    grad_dtype: torch.dtype = E4M3
    fp8_wgrad: bool = False


_BY_GRANULARITY = {"tensor": TensorScaling, "row": RowwiseScaling}
_BY_SHORT = {v: k for k, v in _SHORT.items()}


@functools.lru_cache(maxsize=None)
def recipe_from_key(key: str) -> Recipe:
    """The recipe :meth:`Recipe.key` named."""
    if not isinstance(key, str):
        raise ValueError(f"opfuse.fp8: recipe key {key!r}; expected a string such as "
                         f"'tensor/e4m3/e5m2/wgrad-fp8' (Recipe.key())")
    try:
        granularity, forward, grad, wgrad, *extra = key.split("/")
        cls = _BY_GRANULARITY[granularity]
        if _BY_SHORT[forward] != E4M3 or wgrad not in ("wgrad-fp8", "wgrad-hp") or extra not in ([], ["w-pow2"]):
            raise KeyError(forward)
        return cls(grad_dtype=_BY_SHORT[grad], fp8_wgrad=wgrad == "wgrad-fp8", pow2_weight_scales=bool(extra))
    except (KeyError, ValueError):
        raise ValueError(f"opfuse.fp8: recipe key {key!r}; expected e.g. 'tensor/e4m3/e5m2/wgrad-fp8' "
                         f"(granularity tensor|row, grad e5m2|e4m3, wgrad-fp8|wgrad-hp, then optionally "
                         f"/w-pow2)") from None
