"""Unsharded checkpoints of tensor-parallel blocks.

A block's ``state_dict()`` holds each rank's *shards*. :func:`unsharded_state_dict` all-gathers
them into the full tensors, keyed as the ``state_dict()`` of the same model built unsharded
(``parallel=None``), so a checkpoint can be saved once, reloaded at any world size, or opened by
code that knows nothing about opfuse. :func:`load_unsharded_state_dict` goes the other way.

Layouts (``world`` = the op's process-group size, ``r`` = this rank):

* ``Linear(parallel="column")``: ``weight [out/world, in]`` = rows ``r*out/world ...`` of the
  full weight, ``bias [out/world]`` likewise.
* ``Linear(parallel="row")``: ``weight [out, in/world]`` = columns ``r*in/world ...``; the bias is
  replicated (``[out]``, added once after the reduction).
* ``GatedLinear(parallel="column")``: ``gate_weight``, ``up_weight`` (and biases) are each a
  column shard of their own full tensor, as a column ``Linear``'s.
* ``GroupedLinear``: ``"expert"`` splits the experts (dim 0 of ``[G, N, K]``) over ``group``;
  ``"fsdp"`` splits the rows of the ``[G*N, K]`` view over ``group``; ``"expert+fsdp"`` does the
  first over ``group`` and the second over ``fsdp_group``.

Both functions are collective: every rank of every group involved must call them.

Example::

    full = opfuse.unsharded_state_dict(block)          # on every rank
    if dist.get_rank() == 0:
        torch.save(full, "block.pt")
    ...
    opfuse.load_unsharded_state_dict(block, torch.load("block.pt"))
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .ops import GatedLinear, GroupedLinear, Linear
from .ops import group as groups

__all__ = ["unsharded_state_dict", "load_unsharded_state_dict"]


def _gather(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenation along ``dim`` of ``t`` from every rank of ``group`` (rank order)."""
    group = groups.resolve(group, "unsharded_state_dict")
    world = dist.get_world_size(group)
    if world == 1:
        return t.detach().clone()
    t = t.detach().contiguous()
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=dim)


def _full_linear(op: Linear) -> dict[str, torch.Tensor]:
    out = {}
    if op.parallel == "column":
        out["weight"] = _gather(op.weight, op.group, 0)
        if op.bias is not None:
            out["bias"] = _gather(op.bias, op.group, 0)
    elif op.parallel == "row":
        out["weight"] = _gather(op.weight, op.group, 1)
        if op.bias is not None:
            out["bias"] = op.bias.detach().clone()
    return out


def _full_gated(op: GatedLinear) -> dict[str, torch.Tensor]:
    return {name: _gather(t, op.group, 0) for name, t in op.named_parameters(recurse=False)}


def _full_grouped(op: GroupedLinear) -> dict[str, torch.Tensor]:
    out = {}
    local_groups = op.local_num_groups
    for name in ("weight", "bias"):
        t = getattr(op, name)
        if t is None:
            continue
        if op.fsdp:  # rows of the [local G * N, (K)] view, over the FSDP group
            t = _gather(t, op.fsdp_group, 0).view(local_groups, op.out_features, *t.shape[1:])
        if op.parallel in ("expert", "expert+fsdp"):
            t = _gather(t, op.expert_group, 0)
        out[name] = t
    return out


def unsharded_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The ``state_dict`` of ``module`` with every sharded parameter all-gathered to its full
    tensor, keyed as the ``state_dict()`` of the same model built with ``parallel=None``.

    Handles ``ops.Linear`` (column, row; with bias), ``ops.GatedLinear`` (column) and
    ``ops.GroupedLinear`` (``expert``, ``fsdp``, ``expert+fsdp``); everything else is replicated
    and copied as is. Collective: call it on
    every rank. Tensors stay on the parameters' device.

    Examples
    --------
    >>> full = opfuse.unsharded_state_dict(block)            # doctest: +SKIP
    >>> plain = build_block(parallel=None); plain.load_state_dict(full)   # doctest: +SKIP
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"opfuse.unsharded_state_dict: module={module!r}; expected a torch.nn.Module")
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    for prefix, sub in module.named_modules():
        if isinstance(sub, Linear) and sub.parallel:
            full = _full_linear(sub)
        elif isinstance(sub, GatedLinear) and sub.parallel:
            full = _full_gated(sub)
        elif isinstance(sub, GroupedLinear) and sub.parallel:
            full = _full_grouped(sub)
        else:
            continue
        for name, tensor in full.items():
            state[f"{prefix}.{name}" if prefix else name] = tensor
    return state


def _local_part(full: torch.Tensor, index: int, parts: int, dim: int) -> torch.Tensor:
    size = full.shape[dim] // parts
    return full.narrow(dim, index * size, size)


def load_unsharded_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True):
    """Load full tensors (as :func:`unsharded_state_dict` returns, or the ``state_dict`` of the
    unsharded model) into a sharded ``module``: every rank copies its own part. Not collective.
    Returns ``module.load_state_dict``'s result (missing / unexpected keys)."""
    local = dict(state_dict)
    for prefix, sub in module.named_modules():
        key = (prefix + ".") if prefix else ""
        if isinstance(sub, Linear) and sub.parallel:
            for name, dim in (("weight", 0 if sub.parallel == "column" else 1), ("bias", 0)):
                if key + name not in local or (name == "bias" and sub.parallel == "row"):
                    continue
                local[key + name] = _local_part(local[key + name], sub.rank, sub.world_size, dim)
        elif isinstance(sub, GatedLinear) and sub.parallel:
            for name, _ in sub.named_parameters(recurse=False):
                if key + name in local:
                    local[key + name] = _local_part(local[key + name], sub.rank, sub.world_size, 0)
        elif isinstance(sub, GroupedLinear) and sub.parallel:
            for name in ("weight", "bias"):
                if key + name not in local:
                    continue
                full = _local_part(local[key + name], sub.expert_rank, sub.expert_world, 0)
                if sub.fsdp:
                    full = _local_part(full.reshape(-1, *full.shape[2:]), sub.fsdp_rank, sub.fsdp_world, 0)
                local[key + name] = full
    return module.load_state_dict(local, strict=strict)
