"""Ops that connect a block to values outside its main chain: :class:`AddExtraInput`,
:class:`MakeExtraOutput`, and :class:`Identity`.

Conventions follow Transformer Engine's op API: ``Sequential(x, *extra_inputs)`` hands extra
inputs to the ops that declare them, left to right, and returns ``(y, *extra_outputs)`` with extra
outputs in op order.
"""

from __future__ import annotations

from .base import BasicOp, PartitionError, TensorMeta, check_meta_equal
from .sharding import Sharding, reject_partial

__all__ = ["AddExtraInput", "MakeExtraOutput", "Identity"]


class AddExtraInput(BasicOp):
    """``y = x + extra``: adds the next extra input (e.g. the residual). Shapes, dtypes and
    devices must match exactly (no broadcasting)."""

    num_extra_inputs = 1

    def forward(self, x, extra):
        return x + extra

    def propagate_sharding(self, x: Sharding, *extra: Sharding) -> Sharding:
        """Elementwise: the extra input must be laid out like ``x`` (a block's extra inputs take the
        layout of the value they meet)."""
        reject_partial(self, x)
        if extra and extra[0] != x:
            raise PartitionError(f"{self.describe()}: the extra input is {extra[0].describe()} but the value it is "
                                 f"added to is {x.describe()}")
        return x

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        (other,) = extra
        check_meta_equal(self, "extra input", other, x)
        return x.with_(requires_grad=x.requires_grad or other.requires_grad)


class MakeExtraOutput(BasicOp):
    """Pass ``x`` through and also return it as an extra output (e.g. the new residual).

    Its gradient is the sum of the gradients of both uses.
    """

    num_extra_outputs = 1
    keeps_quantized = True
    #: The extra output is the op's own output (no separate tensor).
    extra_output_is_main = True

    def forward(self, x):
        return x

    def propagate_sharding(self, x: Sharding, *extra) -> Sharding:
        return x

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        return x


class Identity(BasicOp):
    """``y = x``."""

    keeps_quantized = True

    def forward(self, x):
        return x

    def propagate_sharding(self, x: Sharding, *extra) -> Sharding:
        return x

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        return x
