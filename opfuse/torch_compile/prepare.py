"""Model-level rewrites :func:`opfuse.optimize` makes before compiling (:func:`prepare_model`).

Two things cannot be done on the graphs torch.compile captures, because what they need is gone
by then: mixture-of-experts layers written as a per-expert loop (:mod:`.moe`: the loop is
data-dependent, Dynamo never sees it as one operation) and weights stored apart (:mod:`.merge_projections`:
a graph can only copy separate inputs together). Both are rewrites of the ``nn.Module`` that keep
its parameters, ``state_dict`` keys and values, and hooks; both are reported (``explain()``) and
can be turned off.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from .merge_projections import PackedParameters, find_projection_groups, merge_projections_
from .moe import rewrite_moe_, stacked_experts_router

__all__ = ["Prepared", "prepare_model"]


@dataclasses.dataclass
class Prepared:
    """What :func:`prepare_model` did: ``notes`` (shown by every program's ``explain()``),
    ``packed`` (the parameters it stores back to back; :meth:`PackedParameters.ensure` re-packs
    them if they were moved) and ``routers`` (ids of the MoE routers' linears, kept in high
    precision under FP8)."""

    notes: list[str] = dataclasses.field(default_factory=list)
    packed: PackedParameters = dataclasses.field(default_factory=PackedParameters)
    routers: set[int] = dataclasses.field(default_factory=set)


def prepare_model(model: nn.Module, *, merge_projections: bool = True, moe: bool = True) -> Prepared:
    """Rewrite ``model`` in place for compiling (module docstring): with ``moe``, Hugging Face
    style MoE blocks become grouped GEMMs; with ``merge_projections``, sibling projections (q/k/v,
    gate/up) are stored back to back so that one GEMM reads them without a copy.

    ``opfuse.optimize`` calls it; call it yourself before ``torch.compile(model, backend="opfuse")``
    to get the same rewrites.

    Examples
    --------
    >>> prepared = opfuse.torch_compile.prepare_model(model)          # doctest: +SKIP
    >>> print("\\n".join(prepared.notes))                              # doctest: +SKIP
    >>> fast = torch.compile(model, backend="opfuse")                  # doctest: +SKIP
    """
    for flag, name in ((merge_projections, "merge_projections"), (moe, "moe")):
        if not isinstance(flag, bool):
            raise TypeError(f"opfuse.optimize: {name}={flag!r}; expected True or False")
    prepared = Prepared()
    if moe:
        prepared.notes.extend(f"moe: {note}" for note in rewrite_moe_(model, prepared.packed))
        for module in model.modules():
            spec = getattr(module, "_opfuse_moe", None)
            if spec is not None:
                prepared.routers.add(id(getattr(module, spec.router)))
    for name, block in model.named_modules():
        router = stacked_experts_router(block)
        if router is not None:  # routing stays in high precision under FP8, rewritten block or not
            prepared.routers.add(id(router))
            prepared.notes.append(f"moe: {name or '(model)'} ({type(block).__name__}): experts stored stacked, "
                                  f"no rewrite needed (their grouped GEMMs, torch._grouped_mm or transformers' "
                                  f"grouped_mm_fallback, are recognised in the graph; the fusions list says which fused); "
                                  f"router kept in high precision under FP8")
    if merge_projections:
        experts = {id(module) for block in model.modules() if getattr(block, "_opfuse_moe", None) is not None
                   for module in block.experts.modules()}
        groups = [g for g in find_projection_groups(model) if id(model.get_submodule(g.parent)) not in experts]
        before = len(prepared.packed)
        merge_projections_(model, prepared.packed, groups)
        merged = prepared.packed.labels[before:]
        sharded = sum(1 for m in model.modules() if isinstance(m, nn.Linear) and hasattr(m.weight, "_spec"))
        if sharded:
            prepared.notes.append(f"merge_projections: {sharded} linear(s) with DTensor weights left apart (torch "
                                  f"cannot trace a DTensor whose shard is a view of a shared buffer)")
        if merged:
            prepared.notes.append(f"merge_projections: weights stored back to back (one GEMM reads each group "
                                  f"without a copy where the graph gives them one input): {', '.join(merged)}")
    return prepared
