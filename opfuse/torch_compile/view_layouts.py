"""Keeping the graph's views valid where fused ops return other strides than the ops they replace.

AOTAutograd traced the model's views (``view``, ``_unsafe_view``) on the values its own ops
returned, with their strides, and recorded those strides in every node's fake value. A fused op
may return the same values with other strides: the merged q/k/v GEMM returns column slices of one
``[tokens, q + k + v]`` tensor where three GEMMs returned three contiguous tensors, and a fused norm
returns a contiguous tensor where the unfused norm of a transposed input kept its input's layout.
Pointwise ops after it then produce other strides too, and a view further on that flattens dims
across them (Qwen3's per-head norm, ``view(-1, head_dim)``; Gemma 3's ``transpose(1, 2)`` then
``view(B, S, -1)``) fails when the graph runs.

:func:`refresh_layouts` replays the fake values downstream of the values whose layout changed (a
worklist that stops where the layout comes out as before), and hands a view that cannot be taken
a contiguous copy of its input instead (Inductor folds such a copy into the neighbouring kernels;
the eager path pays one copy where the model's own layout would have needed none). A view that
reads storage directly (``as_strided``) of a value whose layout changed cannot be mended that way:
it is an error naming the node, never a silently different result.
"""

from __future__ import annotations

import torch
from torch import fx

from ..machinery.aten import aten, calls, is_static_size, known_equal
from ..machinery.aten import value as fake_value

__all__ = ["LayoutError", "refresh_layouts", "same_layout"]

#: Views that need strides compatible with their shape: given a contiguous input when not.
_STRICT_VIEWS = (aten.view, aten._unsafe_view)
#: Views whose result is defined by the input's storage, not by its values.
_STORAGE_VIEWS = (aten.as_strided,)


class LayoutError(RuntimeError):
    """A fused op's output layout breaks a view of the graph that no copy can mend."""


def same_layout(a, b) -> bool:
    """Equal shapes, strides and storage offsets (known equal for every size, no guards); for
    tuples, item by item; other values are compared with ``==`` only when both are not tensors."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dim() != b.dim() or a.dtype != b.dtype:
            return False
        pairs = list(zip(a.shape, b.shape)) + list(zip(a.stride(), b.stride()))
        pairs.append((a.storage_offset(), b.storage_offset()))
        return all(known_equal(x, y) for x, y in pairs)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_layout(x, y) for x, y in zip(a, b))
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor)


def refresh_layouts(graph: fx.Graph, fake_mode, changed: set[fx.Node]) -> int:
    """Bring the fake values downstream of ``changed`` (nodes whose value now has another layout
    than the graph was traced with; their own fake values are current) up to date, mending views
    that cannot be taken. Returns the number of contiguous copies inserted."""
    copies = 0
    dirty = set(changed)
    for node in list(graph.nodes):
        if node in changed or node.op != "call_function":
            continue
        if not any(arg in dirty for arg in node.all_input_nodes):
            continue
        old = fake_value(node)
        if calls(node, *_STORAGE_VIEWS):
            raise LayoutError(f"opfuse: {node.name} (as_strided) reads {node.args[0].name}, whose layout a fusion "
                              f"changed; as_strided would read other elements")
        new = _run(node, fake_mode)
        if calls(node, *_STRICT_VIEWS) and isinstance(new, torch.Tensor) and not _viewable(fake_value(node.args[0]), new):
            new = _FAILED
        if new is _FAILED and calls(node, *_STRICT_VIEWS):
            source = node.args[0]
            with graph.inserting_before(node):
                copy = graph.call_function(aten.clone.default, (source,), {"memory_format": torch.contiguous_format})
            with fake_mode:
                copy.meta["val"] = fake_value(source).clone(memory_format=torch.contiguous_format)
            node.replace_input_with(source, copy)
            copies += 1
            new = _run(node, fake_mode)
        if new is _FAILED or new is _UNKNOWN:
            # Not replayable on fake tensors (no fake value recorded, a data-dependent op): it keeps
            # the value it was traced with, and what follows it is not revisited through it.
            continue
        node.meta["val"] = new
        if not same_layout(old, new):
            dirty.add(node)
    return copies


_FAILED, _UNKNOWN = object(), object()


def _hint(size):
    """A size as a plain int (a symbol's hint: the value it was traced with), or ``None``."""
    if is_static_size(size):
        return int(size)
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if is_static_size(hint) else None


def _viewable(source, result) -> bool:
    """Whether a real tensor laid out as fake value ``source`` can be viewed with ``result``'s
    shape. A fake tensor's ``view`` is not the judge: it accepts some that real tensors refuse,
    where a size-1 dim sits among the dims it flattens (torch 2.13: ``[2, 1, 4, 8]`` with strides
    ``(64, 32, 8, 1)``, a column slice of a merged q/k/v GEMM at one token per sequence, viewed as
    ``[-1, 8]``; the graph then failed when it ran). :func:`_view_strides` is the check real
    tensors run. ``True`` when a size is unknown."""
    if not isinstance(source, torch.Tensor) or not isinstance(result, torch.Tensor):
        return True
    sizes, strides = [_hint(s) for s in source.shape], [_hint(s) for s in source.stride()]
    shape = [_hint(s) for s in result.shape]
    if None in sizes or None in strides or None in shape:
        return True
    return _view_strides(sizes, strides, shape) is not None


def _view_strides(sizes: list[int], strides: list[int], shape: list[int]) -> list[int] | None:
    """The strides of ``view(shape)`` of a tensor with ``sizes`` and ``strides``, ``None`` when no
    view can be taken: ATen's ``computeStride`` (``aten/src/ATen/TensorUtils.cpp``). Dims are
    merged in chunks of memory-contiguous dims (size-1 dims belong to any chunk); each chunk must
    map onto whole dims of the new shape."""
    numel = 1
    for size in sizes:
        numel *= size
    if numel == 0:
        return list(strides) if sizes == shape else list(_contiguous(shape))
    if not sizes:
        return [1] * len(shape)
    new = [0] * len(shape)
    view_d = len(shape) - 1
    chunk_base_stride = strides[-1]
    tensor_numel = view_numel = 1
    for tensor_d in range(len(sizes) - 1, -1, -1):
        tensor_numel *= sizes[tensor_d]
        if tensor_d == 0 or (sizes[tensor_d - 1] != 1 and strides[tensor_d - 1] != tensor_numel * chunk_base_stride):
            while view_d >= 0 and (view_numel < tensor_numel or shape[view_d] == 1):
                new[view_d] = view_numel * chunk_base_stride
                view_numel *= shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if tensor_d > 0:
                chunk_base_stride = strides[tensor_d - 1]
                tensor_numel = view_numel = 1
    return new if view_d == -1 else None


def _contiguous(shape: list[int]):
    stride = 1
    out = []
    for size in reversed(shape):
        out.append(stride)
        stride *= max(size, 1)
    return reversed(out)


def _run(node: fx.Node, fake_mode):
    """``node``'s fake value computed from its inputs' current ones; ``_FAILED`` when the op
    raises, ``_UNKNOWN`` when an input has no fake value."""
    missing = []

    def arg(a):
        if isinstance(a, fx.Node):
            val = fake_value(a)
            if val is None:
                missing.append(a)
            return val
        return a

    args = fx.node.map_aggregate(node.args, arg)
    kwargs = fx.node.map_aggregate(node.kwargs, arg)
    if missing:
        return _UNKNOWN
    try:
        with fake_mode:
            return node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the op cannot run on these layouts (or not without a guard)
        return _FAILED
