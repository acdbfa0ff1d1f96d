"""GroupedLinear (mixture-of-experts grouped GEMM). Placeholder until issue 6 lands."""

from __future__ import annotations

from .base import BasicOp

__all__ = ["GroupedLinear"]


class GroupedLinear(BasicOp):
    """Not implemented yet."""

    num_extra_inputs = 1

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("ops.GroupedLinear is not implemented yet")
