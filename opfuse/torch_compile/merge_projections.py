"""Merged projections without copies: ``opfuse.optimize(model, merge_projections=True)``.

Sibling ``nn.Linear`` layers that may read the same input (q, k and v; gate and up) run as one
GEMM over their weights joined row-wise (the ``horizontal_gemm`` pass). In a compiled graph each
weight is a separate input; joining them on every call would copy them. So before compiling,
opfuse re-lays the parameters out: the weights of each group of sibling linears with the same
input size, dtype and device (in registration order: ``q, k, v, o``; ``gate, up``) are moved into
one new buffer, and each original ``nn.Parameter`` becomes a view of its rows (``param.data`` is
re-pointed, as Megatron-LM's contiguous parameter buffers do). The graph then receives views of
one storage; the compiler sees that (fake tensors keep the aliasing) and reads them as one
``as_strided`` view of the first: one GEMM, no copy. Which linears actually read the same value is
decided on the graph (a sibling that reads another input, like ``o``, is simply left alone).

What holds, exactly:

* ``model.parameters()`` yields the same ``nn.Parameter`` objects; ``state_dict()`` has the same keys
  and values (each value is a view into the shared buffer; ``torch.save`` writes the buffer once,
  and loading it anywhere gives the same tensors); ``load_state_dict`` copies into the views.
* Optimizers keep working: they update each parameter in place (its view); their state is keyed by
  the unchanged parameter objects.
* Gradients: each parameter gets its own ``.grad`` (a separate tensor, as without merging).
* Moving or replacing parameters afterwards (``model.to(...)``, ``load_state_dict(assign=True)``,
  ``p.data = ...``) separates them again: the model returned by :func:`opfuse.optimize` re-packs them
  before its next call (values kept, parameter objects kept), and a compiled graph that read them
  as one view refuses to run on a layout it was not compiled for (:mod:`.layout_guard`).
* Tensors that share memory are refused by ``safetensors.torch.save_file``; save
  ``{k: v.clone() for k, v in model.state_dict().items()}`` there (``torch.save`` is fine).

DTensor parameters (tensor parallelism through ``parallelize_module``) are not merged: torch cannot
make the fake tensors Dynamo traces with for a DTensor whose local shard is a view of a shared
buffer. Tensor parallelism written with ``torch.distributed`` calls (each rank's shards are plain
parameters) is merged like an unsharded model.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..ops.packing import adjacent, pack_rows_, storage_address

__all__ = ["ProjectionGroup", "PackedParameters", "find_projection_groups", "merge_projections_"]


@dataclasses.dataclass(frozen=True)
class ProjectionGroup:
    """Sibling linears of module ``parent`` (fully qualified name) merged into one buffer."""

    parent: str
    names: tuple[str, ...]

    def describe(self) -> str:
        prefix = f"{self.parent}." if self.parent else ""
        return prefix + "{" + ", ".join(self.names) + "}"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor whose storage is re-pointed), else ``t``."""
    if type(t) is nn.Parameter or type(t) is torch.Tensor:
        return t
    return getattr(t, "_local_tensor", t)


def _layout(t: torch.Tensor):
    spec = getattr(t, "_spec", None)
    if spec is None:
        return None
    return (tuple(spec.placements), id(spec.mesh))


def _key(linear: nn.Linear):
    weight, bias = linear.weight, linear.bias
    if _layout(weight) is not None:
        # DTensor: torch cannot make fake tensors of a DTensor whose local shard is a view of
        # another tensor (Dynamo fails on it), so sharded parameters stay where they are.
        return None
    local = _local(weight)
    if local.dim() != 2 or not local.is_contiguous() or local.device.type == "meta":
        return None
    bias_key = None if bias is None else (_local(bias).dtype, _layout(bias), bias.requires_grad)
    return (local.shape[1], local.dtype, local.device, weight.requires_grad, _layout(weight), bias_key)


def find_projection_groups(model: nn.Module) -> list[ProjectionGroup]:
    """Groups (>= 2) of sibling ``nn.Linear`` children with the same input size, dtype, device,
    gradient flag, bias presence and tensor-parallel layout, in registration order."""
    found, seen = [], set()
    for parent_name, parent in model.named_modules():
        by_key: dict = {}
        for name, child in parent.named_children():
            if not isinstance(child, nn.Linear) or not isinstance(child.weight, nn.Parameter):
                continue
            if id(child.weight) in seen or (child.bias is not None and id(child.bias) in seen):
                continue  # shared with another group (tied weights)
            key = _key(child)
            if key is not None:
                by_key.setdefault(key, []).append(name)
        for names in by_key.values():
            if len(names) >= 2:
                found.append(ProjectionGroup(parent_name, tuple(names)))
                for name in names:
                    child = parent.get_submodule(name)
                    seen.update({id(child.weight)} | ({id(child.bias)} if child.bias is not None else set()))
    return found


class PackedParameters:
    """Parameters opfuse stores back to back: ``groups`` of ``[(module, attr), ...]`` (looked up
    again at each check, so replaced parameters are packed too).

    :meth:`ensure` runs before every call of the optimized model, so its common case (nothing
    moved) is one pass over the members reading where each starts: a model of 32 layers has 64
    groups, and a full adjacency check of each cost ~0.6 ms of host time per call, which a decode
    loop that syncs per token pays in full."""

    def __init__(self):
        self.groups: list[list[tuple[nn.Module, str]]] = []
        self.labels: list[str] = []
        self._members: list[tuple[nn.Module, str]] = []  # every group's members, flat
        self._lasts: list[int] = []  # index in ``_members`` of each group's last member
        self._packed_at = None  # :meth:`_where` when every group was last seen packed

    def add(self, members: list[tuple[nn.Module, str]], label: str) -> None:
        self.groups.append(members)
        self.labels.append(label)
        self._members.extend(members)
        self._lasts.append(len(self._members) - 1)
        self._packed_at = None

    def __len__(self) -> int:
        return len(self.groups)

    def _where(self) -> tuple:
        """Each member's address and element count, and the storage address of each group's last
        member. Equal to the value taken when every group was adjacent means adjacent still: a
        member re-pointed (``.data =``, ``model.to``) or replaced moves its address; re-allocated
        at its old address it lies in a storage of its own (a member gets its old address back
        only once the whole group left the shared buffer, so the last member's storage, which
        starts at the first member while packed, shows it); resized, its element count differs."""
        tensors = [module._parameters.get(attr) for module, attr in self._members]
        if set(map(type, tensors)) == {nn.Parameter}:  # the common case, at C speed
            return (tuple(map(torch.Tensor.data_ptr, tensors)), tuple(map(torch.Tensor.numel, tensors)),
                    tuple(map(storage_address, map(tensors.__getitem__, self._lasts))))
        # Absent members (bias=None), DTensors, tensors that are not registered parameters.
        tensors = [_local(_member(module, attr)) for module, attr in self._members]
        return (tuple(None if t is None else (t.data_ptr(), t.numel()) for t in tensors),
                tuple(storage_address(tensors[i]) for i in self._lasts))

    def ensure(self) -> int:
        """Pack every group that is not (or no longer) stored back to back; returns how many
        were packed."""
        if self._packed_at is not None and self._where() == self._packed_at:
            return 0
        packed = 0
        for members in self.groups:
            tensors = [_local(_member(module, attr)) for module, attr in members]
            if any(t is None for t in tensors) or adjacent(tensors):
                continue
            with torch.no_grad():
                pack_rows_(tensors)
            packed += 1
        self._packed_at = self._where()
        return packed

    def check_hook(self):
        """A forward pre-hook (for the compiled module) that re-packs moved parameters."""
        def hook(module, args):
            self.ensure()

        return hook


def _member(module: nn.Module, attr: str):
    """``getattr(module, attr)``, reading a registered parameter from its dict directly
    (``nn.Module.__getattr__`` is ten times slower, and this runs per member per call)."""
    found = module._parameters.get(attr)
    return found if found is not None else getattr(module, attr, None)


def merge_projections_(model: nn.Module, packed: PackedParameters | None = None,
                       groups: list[ProjectionGroup] | None = None) -> PackedParameters:
    """Store the weights (and biases) of each group (default: :func:`find_projection_groups`)
    back to back (module docstring). Returns the :class:`PackedParameters` (``packed`` extended)."""
    packed = packed if packed is not None else PackedParameters()
    for group in find_projection_groups(model) if groups is None else groups:
        parent = model.get_submodule(group.parent)
        linears = [parent.get_submodule(n) for n in group.names]
        packed.add([(lin, "weight") for lin in linears], group.describe())
        if all(lin.bias is not None for lin in linears):
            packed.add([(lin, "bias") for lin in linears], group.describe() + " biases")
    packed.ensure()
    return packed
