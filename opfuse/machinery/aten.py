"""Small questions about nodes of the aten graphs Inductor compiles: which op a node calls, its
fake value, its scalar arguments.

The graphs are AOTAutograd's joint (or inference) graphs after Inductor's decompositions: core
aten ops, ``prims.convert_element_type`` for dtype casts, and functional collectives
(``_c10d_functional.all_reduce`` + ``wait_tensor``) for every collective, whether the model
called ``torch.distributed`` or DTensor issued it.
"""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["aten", "c10d", "calls", "value", "shape", "dtype", "scalar", "is_tensor_node", "only_user",
           "users_calling", "is_cast_to", "last_dim", "before_upcast"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def calls(node, *ops) -> bool:
    """``node`` calls one of ``ops`` (overloads such as ``aten.mm.default`` or packets such as
    ``aten.add``)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    return any(target is op or packet is op for op in ops)


def value(node):
    """The fake tensor (or tuple of them) AOTAutograd recorded for ``node``; ``None`` if unknown."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def is_tensor_node(node) -> bool:
    return isinstance(value(node), torch.Tensor)


def shape(node) -> tuple | None:
    val = value(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def dtype(node):
    val = value(node)
    return val.dtype if isinstance(val, torch.Tensor) else None


def last_dim(node) -> int | None:
    dims = shape(node)
    return dims[-1] if dims else None


def scalar(arg) -> float | None:
    """A Python number argument (not a tensor), else ``None``."""
    if isinstance(arg, bool):
        return None
    return float(arg) if isinstance(arg, (int, float)) else None


def only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def users_calling(node: fx.Node, *ops) -> list[fx.Node]:
    return [user for user in node.users if calls(user, *ops)]


def is_cast_to(node, target_dtype=None) -> bool:
    """``node`` converts a tensor's dtype (to ``target_dtype`` when given)."""
    if not calls(node, torch.ops.prims.convert_element_type.default):
        return False
    if target_dtype is None:
        return True
    return dtype(node) == target_dtype


def before_upcast(xf: fx.Node) -> fx.Node:
    """The tensor a float32 computation started from: ``x`` of ``x.float()`` for half-precision
    inputs (norms and activations upcast before their arithmetic), else ``xf`` itself."""
    if is_cast_to(xf, torch.float32) and dtype(xf.args[0]) in (torch.bfloat16, torch.float16):
        return xf.args[0]
    return xf
