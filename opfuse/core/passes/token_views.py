"""Traced reshapes that only regroup the leading token dims of a value (``[1, S, H] -> [S, H]``).

Fused ops treat every leading dim as tokens, so an op reading a value through such a reshape reads
the same rows and features: the passes that look through it (``all_gather_keep``, the FP8
quantization's placement, the batch > 1 reduce-scatter) share this one definition.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import fx

__all__ = ["RESHAPES", "token_view"]

#: The aten ops a traced graph reshapes with.
RESHAPES = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)


def _opfuse_meta(node: fx.Node):
    return node.meta.get("opfuse_meta")


def token_view(node: fx.Node, meta: Callable[[fx.Node], object] | None = None) -> bool:
    """``node`` reshapes its first input keeping its rows and features (the last dim and the
    element count); ``meta(node)``: a value's metadata with a ``shape`` (default: its
    ``opfuse_meta``)."""
    if node.op != "call_function" or node.target not in RESHAPES or not node.args \
            or not isinstance(node.args[0], fx.Node):
        return False
    meta = meta or _opfuse_meta
    shapes = [getattr(meta(n), "shape", None) for n in (node, node.args[0])]
    return (all(s is not None and len(s) >= 2 for s in shapes) and shapes[0][-1] == shapes[1][-1]
            and math.prod(shapes[0]) == math.prod(shapes[1]))
