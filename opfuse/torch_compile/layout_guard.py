"""Guarding what a compiled graph assumes about where its inputs live.

Weights stored back to back (``opfuse.optimize(merge_projections=True)``, the experts of a rewritten
MoE layer, :func:`opfuse.ops.packing.pack_rows_`) are joined in the graph as one view of their
storage: ``as_strided(w_q, [3n, k], ...)`` reads ``w_k`` and ``w_v`` through ``w_q``'s storage, no copy.
That view is only right while the parameters still share that storage at the same offsets, and
Dynamo does not guard it (its guards check each input's shape, strides, dtype and device, not
where two inputs lie relative to each other). A model moved or reloaded after compiling
(``model.to(...)`` re-allocates every parameter; ``load_state_dict(assign=True)`` replaces them)
would leave the graph reading stale values.

So the backend wraps each compiled graph that joins inputs this way with a check of the inputs it
joins, per call: every member in the first's storage, at the offset it had when compiled (two
address reads per tensor). A mismatch raises :class:`LayoutChanged` naming the parameters; nothing
runs on stale values.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch import fx

from ..machinery.aten import aten, calls, value
from ..ops.packing import storage_address
from .inputs import input_key

__all__ = ["LayoutChanged", "JoinedInputs", "joined_inputs", "guard_layouts"]


class LayoutChanged(RuntimeError):
    """Inputs a compiled graph reads as one view of their shared storage no longer share it."""


@dataclasses.dataclass(frozen=True)
class JoinedInputs:
    """Dynamo inputs ``indices`` (with the inner-tensor attribute of a subclass input, e.g. a
    DTensor's ``_local_tensor``) that must lie at ``offsets`` (bytes, from the first's start) in
    one storage."""

    indices: tuple[int, ...]
    attrs: tuple[tuple[str, ...], ...]
    offsets: tuple[int, ...]


def _extent(val) -> tuple[int, int]:
    """``[first, last]`` element of a strided tensor within its storage."""
    last = val.storage_offset() + sum((size - 1) * stride for size, stride in zip(val.shape, val.stride()) if size)
    return val.storage_offset(), last


def joined_inputs(graph: fx.Graph) -> list[JoinedInputs]:
    """Groups of graph inputs that some ``as_strided`` view of one of them reaches into."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder" and isinstance(value(n), torch.Tensor)]
    found, seen = [], set()
    for node in graph.nodes:
        if not calls(node, aten.as_strided.default) or node.args[0] not in placeholders:
            continue
        source, view = value(node.args[0]), value(node)
        if not isinstance(view, torch.Tensor) or view.numel() == 0:
            continue
        start, end = _extent(view)
        own_start, own_end = _extent(source)
        if own_start <= start and end <= own_end:
            continue  # within the input itself
        storage = source.untyped_storage()._cdata
        members = []
        for p in placeholders:
            val = value(p)
            try:
                same = val.untyped_storage()._cdata == storage
            except (RuntimeError, NotImplementedError):
                same = False
            if same and val.numel():
                p_start, p_end = _extent(val)
                if p_start <= end and start <= p_end:
                    members.append((p_start, p, val))
        members.sort(key=lambda item: item[0])
        keys = [input_key(p.meta.get("desc")) for _, p, _ in members]
        if len(members) < 2 or any(k is None or k[0] != "in" for k in keys):
            continue
        base = members[0][0]
        group = JoinedInputs(tuple(k[1] for k in keys), tuple(tuple(k[2:]) for k in keys),
                             tuple((start_ - base) * val.element_size() for start_, _, val in members))
        if group not in seen:
            seen.add(group)
            found.append(group)
    return found


def _innermost(fn):
    """``fn`` without its ``torch._dynamo.disable`` wrappers (``fn`` itself if it has none)."""
    while getattr(fn, "_torchdynamo_disable", False) and getattr(fn, "_torchdynamo_orig_callable", None) is not None:
        fn = fn._torchdynamo_orig_callable
    return fn


def _inner(tensor, attrs):
    if not attrs:
        return tensor
    for attr in attrs:
        tensor = getattr(tensor, attr)
    return tensor


def guard_layouts(compiled, groups: list[JoinedInputs], names: list[str | None]):
    """``compiled`` (a Dynamo backend's result), checking ``groups`` before each call.

    The check runs per call, so its common case is cheap: inputs at the addresses they had at the
    last call that passed the full check (every member in the first's storage at its offset) pass
    as they are. A member moved or replaced has another address; one re-allocated at its old
    address lies in a storage of its own, which the address of each group's last member's storage
    shows (while joined, that storage starts at the group's first member)."""
    if not groups:
        return compiled
    checks = [(g.indices, g.attrs, g.offsets) for g in groups]
    members = [(index, attr) for g in groups for index, attr in zip(g.indices, g.attrs)]
    lasts = [(g.indices[-1], g.attrs[-1]) for g in groups]
    passed = [None]  # where the members were at the last call that passed the full check

    if any(attr for _, attr in members):  # inner tensors of subclass inputs (a DTensor's local shard)
        def where(args) -> tuple:
            return (tuple(_inner(args[i], attr).data_ptr() for i, attr in members),
                    tuple(_inner(args[i], attr).untyped_storage().data_ptr() for i, attr in lasts))
    else:  # plain tensors: picked and read at C speed (this runs per call, for every joined input)
        pick_members = operator.itemgetter(*(i for i, _ in members))
        pick_lasts = operator.itemgetter(*(i for i, _ in lasts), 0)  # >= 2 items: always a tuple

        def where(args) -> tuple:
            return (tuple(map(torch.Tensor.data_ptr, pick_members(args))),
                    tuple(map(storage_address, pick_lasts(args)[:-1])))

    def full_check(args) -> None:
        for indices, attrs, offsets in checks:
            first = _inner(args[indices[0]], attrs[0])
            storage, start = first.untyped_storage().data_ptr(), first.data_ptr()
            for index, attr, offset in zip(indices[1:], attrs[1:], offsets[1:]):
                t = _inner(args[index], attr)
                if t.data_ptr() - start != offset or t.untyped_storage().data_ptr() != storage:
                    who = [names[i] if i < len(names) and names[i] else f"input {i}" for i in indices]
                    raise LayoutChanged(
                        f"opfuse: {', '.join(who)} were stored back to back when this graph was compiled (it reads "
                        f"them as one tensor, without copying) and no longer are: the model's parameters were "
                        f"moved or replaced after compiling (e.g. model.to(...), load_state_dict(assign=True)). "
                        f"Compile again (torch._dynamo.reset(); opfuse.optimize(model)) after moving the model, "
                        f"or pass merge_projections=False")

    def check(args) -> None:
        now = where(args)
        if now != passed[0]:
            full_check(args)
            passed[0] = now

    # Dynamo runs what a backend returns under torch._dynamo.disable, unwrapping a callable that is
    # already disabled (Inductor's) first; ``run`` is wrapped instead, so it calls the callable
    # inside that wrapper: one disable context per call, not two.
    inner = _innermost(compiled)

    def run(*args):
        # Called with the inputs, or (boxed) with one list of them.
        check(args[0] if len(args) == 1 and isinstance(args[0], list) else args)
        return inner(*args)

    if hasattr(compiled, "_boxed_call"):
        run._boxed_call = compiled._boxed_call
    return run
