"""The regions of an aten graph that stand for opfuse ops ("raising"): what a :class:`Region`
is, the helpers the recognisers share, and which interior values a region recomputes.

A :class:`Region` is a set of aten nodes that computes what one basic op computes, with the op
(an instance of the opfuse op class, its parameters stand-ins on the meta device), its inputs and
the node holding its result. Recognizers return regions (:mod:`.recognizer` says how they run;
the torch.compile front end holds its own and the families', :mod:`opfuse.torch_compile.recognition`).

A region may hold interior values that other nodes use (the backward half of a joint graph reads
a norm's ``rsqrt``, a linear's flattened input): they are *recomputed* from the region's inputs
after fusion, so they must not involve a GEMM or a collective (such a region is not raised).

The recognisers are short walks over the graph rather than ``torch._inductor.pattern_matcher``
patterns: a pattern there matches only interior nodes with no other users (which the joint
graph's norms always have), and would need one pattern per operand order, cast placement and
weight position that models write.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx, nn

from .aten import aten, c10d, calls, is_tensor_node, known_equal, shape, value

__all__ = ["ParamSource", "Region", "recompute_closure", "EXPENSIVE", "VIEWS", "is_input", "standin", "frozen",
           "is_vector_of", "other"]

#: Ops a region may not recompute (the work fusion saves, or a collective).
EXPENSIVE = (aten.mm, aten.addmm, aten.bmm, aten._grouped_mm, c10d.all_reduce, c10d.all_gather_into_tensor,
             c10d.reduce_scatter_tensor, c10d.wait_tensor)

VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


@dataclasses.dataclass(frozen=True)
class ParamSource:
    """The graph input a stand-in parameter stands for."""

    node: fx.Node


@dataclasses.dataclass(eq=False)
class Region:
    """aten nodes standing for one opfuse op.

    ``inputs``: the main input, then the extra inputs (``AddExtraInput``'s residual).
    ``value``: the node holding the op's result; ``None`` for the GEMM half of an ``addmm``,
    whose result exists only with the bias added. ``virtual_input``: the region's nodes compute
    from its producer's inputs, not from its main input (the bias half of an ``addmm``).
    ``params``: each stand-in parameter of ``op`` and its source.
    """

    op: nn.Module
    inputs: tuple[fx.Node, ...]
    value: fx.Node | None
    nodes: frozenset[fx.Node]
    params: dict = dataclasses.field(default_factory=dict)
    virtual_input: bool = False
    #: Where the op sits in graph order when it has no value (the ``addmm``).
    anchor: fx.Node | None = None

    @property
    def position(self) -> fx.Node:
        return self.value if self.value is not None else self.anchor

    @property
    def kind(self) -> str:
        return self.op.kind


def is_input(node) -> bool:
    """A value the graph receives (a parameter, a buffer, an input), not one it computes: the
    op graph shows parameters as attributes of ops, so a computed one would hide a dependency."""
    return isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr") and is_tensor_node(node)


def standin(shape_, dtype_, source: fx.Node | None = None) -> nn.Parameter:
    """A meta-device parameter standing for a graph input. With ``source`` (the input's node),
    it mirrors where that input lives: graph inputs that are views of one storage (weights packed
    back to back, see :func:`opfuse.ops.packing.pack_rows_`) get stand-ins that are views of one
    meta storage at the same offsets, so passes can tell adjacent weights apart from separate
    ones (``horizontal_gemm`` merges the former without copying)."""
    mirrored = _mirrored(shape_, dtype_, source)
    if mirrored is not None:
        return nn.Parameter(mirrored, requires_grad=False)
    return nn.Parameter(torch.empty(shape_, device="meta", dtype=dtype_), requires_grad=False)


def _mirrored(shape_, dtype_, source) -> torch.Tensor | None:
    val = value(source) if isinstance(source, fx.Node) else None
    if not isinstance(val, torch.Tensor) or tuple(val.shape) != tuple(shape_) or val.dtype != dtype_:
        return None
    try:
        storage = val.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    if nbytes <= val.numel() * val.element_size():
        return None  # the input owns its storage: nothing to mirror
    bases = source.graph.__dict__.setdefault("_opfuse_standin_storages", {})
    base = bases.get(key)
    if base is None or base.dtype != dtype_:
        if nbytes % val.element_size():
            return None
        base = bases[key] = torch.empty(nbytes // val.element_size(), device="meta", dtype=dtype_)
    return base.as_strided(tuple(val.shape), tuple(val.stride()), val.storage_offset())


def frozen(op: nn.Module) -> nn.Module:
    op.requires_grad_(False)  # stand-ins: gradients flow through the aten graph, never through them
    return op


def is_vector_of(node, size) -> bool:
    dims = shape(node)
    return dims is not None and len(dims) == 1 and known_equal(dims[0], size)


def other(node: fx.Node, known) -> fx.Node | None:
    a, b = node.args[:2]
    if a is known:
        return b
    if b is known:
        return a
    return None


def recompute_closure(region: Region) -> set[fx.Node] | None:
    """Interior nodes of ``region`` that nodes outside it use, with the interior nodes they
    depend on (what stays in the graph after fusion, recomputed from the region's inputs);
    ``None`` when that would recompute a GEMM or a collective."""
    escaping = [n for n in region.nodes if n is not region.value and any(u not in region.nodes for u in n.users)]
    closure: set[fx.Node] = set()
    stack = list(escaping)
    while stack:
        node = stack.pop()
        if node in closure:
            continue
        if calls(node, *EXPENSIVE):
            return None
        closure.add(node)
        stack.extend(a for a in node.all_input_nodes if a in region.nodes)
    return closure
