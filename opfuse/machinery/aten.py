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
           "users_calling", "is_cast_to", "last_dim", "before_upcast", "known_equal", "same_shape",
           "is_static_size"]

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
    """``node``'s shape: ints, and ``torch.SymInt`` for sizes that vary between calls (dynamic
    shapes; compare them with :func:`known_equal` / :func:`same_shape`)."""
    val = value(node)
    return tuple(_size(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def _size(size):
    if isinstance(size, torch.SymInt):
        constant = size.node.maybe_as_int()
        return size if constant is None else constant
    return size


def dtype(node):
    val = value(node)
    return val.dtype if isinstance(val, torch.Tensor) else None


def last_dim(node):
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


# Sizes ---------------------------------------------------------------------------------------------
#
# Graphs compiled for several sequence lengths (dynamic shapes) hold ``torch.SymInt`` token counts.
# Comparing two of them with ``==`` asks the shape environment, which answers by adding a guard
# when the answer is not the same for every value the symbols may take: the graph would then be
# specialised (recompiled for the next length) by a question opfuse asked. These helpers answer
# without guards: "equal" only when equal for every value.


def is_static_size(size) -> bool:
    """``size`` is a plain integer (not a symbol that varies between calls)."""
    return isinstance(size, int) and not isinstance(size, bool)


def known_equal(a, b) -> bool:
    """``a == b`` for sizes (ints or SymInts) when it holds for every value the symbols take;
    never adds a guard."""
    if is_static_size(a) and is_static_size(b):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001 - not sizes: not known to be equal
        return False


def same_shape(a, b) -> bool:
    """Two shapes (tuples of ints or SymInts) known to be equal, without guards."""
    if a is None or b is None or len(a) != len(b):
        return False
    return all(known_equal(x, y) for x, y in zip(a, b))
