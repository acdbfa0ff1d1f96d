"""Choosing an implementation for every fused op, in program order (the same on every rank).

Before the first check that involves a process group on a CUDA device, the group's symmetric
pool is opened (collective, once per group and device), so the implementations' checks can stay
pure. The chosen implementation's ``prepare`` runs right after its check (see
:func:`opfuse.machinery.implementation.choose`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from .. import dispatch as implementations
from ...machinery.fused_op import FusedOp
from ...machinery.implementation import ImplementationError, choose, forced_for
from ...runtime import symm_pool
from ...config import config, parse_force_impl
from ...ops import group as groups

__all__ = ["select_implementations", "forced_implementations"]


def _open_peer_memory(spec) -> None:
    if spec.group_name and spec.world_size > 1 and spec.device.type == "cuda" and torch.cuda.is_available():
        symm_pool.open_pool(groups.from_name(spec.group_name), spec.device)


def forced_implementations() -> dict[str | None, str]:
    """``config.force_impl`` parsed and checked against the implementation table: every named
    fused op exists and has the named implementation; a bare name is an implementation of at
    least one fused op."""
    forced = parse_force_impl(config.force_impl)
    table = implementations.names()
    where = f"OPFUSE_FORCE_IMPL / opfuse.config.force_impl={config.force_impl!r}"
    for op, impl in forced.items():
        if op is None:
            if not any(impl in names for names in table.values()):
                every = sorted({name for names in table.values() for name in names})
                raise ImplementationError(f"{where}: no fused op has an implementation {impl!r}; known: {every}")
        elif op not in table:
            raise ImplementationError(f"{where}: unknown fused op {op!r}; known: {sorted(table)}")
        elif impl not in table[op]:
            raise ImplementationError(f"{where}: fused op {op!r} has no implementation {impl!r}; its "
                                      f"implementations: {table[op]}")
    return forced


def select_implementations(gm: fx.GraphModule, ctx) -> None:
    records = {r.fused_node: r for r in ctx.fusions}
    forced = forced_implementations()
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        op = gm.get_submodule(node.target)
        if not isinstance(op, FusedOp):
            continue
        metas = [a.meta.get("opfuse_meta") if isinstance(a, fx.Node) else None for a in node.args]
        spec = op.call_spec(metas)
        if getattr(ctx, "joint_graph", False) and op.backward_follows_implementation and not spec.requires_grad:
            spec = dataclasses.replace(spec, requires_grad=True)
        _open_peer_memory(spec)
        impls = implementations.for_op(op.name, spec)
        choice = choose(spec, impls, forced_for(op.name, impls, forced))
        op.implementation = choice.impl
        op.skipped = choice.skipped
        node.meta["opfuse_impl"] = choice.name
        record = records.get(node.name)
        if record is not None:
            record.impl = choice.name
            record.skipped = choice.skipped
