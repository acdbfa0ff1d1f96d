"""Raising an aten graph: every region that stands for an opfuse op (:mod:`.recognize_norms`,
:mod:`.recognize_ops`), each aten node in at most one of them."""

from __future__ import annotations

from torch import fx

from ..families.grouped_linear.recognizers import grouped_linear
from ..families.residual_norm.recognizers import gelu, layer_norm, rms_norm
from .recognizers import add, collective, linear
from ..machinery.region import Region, recompute_closure

__all__ = ["find_regions"]


def find_regions(graph: fx.Graph) -> list[Region]:
    """Every region of ``graph``, in graph order of their results; each aten node belongs to at
    most one region (the ``addmm`` pair shares its node)."""
    taken: set[fx.Node] = set()
    found: list[Region] = []

    def claim(region: Region | None) -> None:
        if region is None or region.nodes & taken:
            return
        if region.value is not None and recompute_closure(region) is None:
            return
        taken.update(region.nodes)
        found.append(region)

    nodes = list(graph.nodes)
    for node in nodes:  # norms and activations first: they own muls and adds the others would take
        claim(rms_norm(node) or layer_norm(node) or gelu(node))
    for node in nodes:
        claim(collective(node))
    for node in nodes:
        claim(grouped_linear(node))
    for node in nodes:
        pair = linear(node)
        if pair and not any(r.nodes & taken for r in pair) and all(recompute_closure(r) is not None for r in pair):
            for region in pair:
                taken.update(region.nodes)
                found.append(region)
    kinds = {r.value: r.kind for r in found if r.value is not None}
    for node in nodes:
        claim(add(node, lambda n: kinds.get(n)))
    order = {node: i for i, node in enumerate(nodes)}
    return sorted(found, key=lambda r: (order[r.position], r.virtual_input))
