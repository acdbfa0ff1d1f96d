"""``GraphProgram``: what opfuse did to one graph torch.compile handed it (a :class:`Program`, so
``fusions``, ``dump()`` and ``explain()`` work as for an ``ops.Sequential``)."""

from __future__ import annotations

from torch import fx

from ..core.explain import Explanation, explain_program
from ..core.program import Program
from ..core.rules import rules

__all__ = ["GraphProgram"]

_COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter")


class GraphProgram(Program):
    """The fusions of one compiled graph.

    Attributes
    ----------
    graph_module / unfused_graph_module:
        The graph's op graph after / before fusion: its aten nodes, with the ops opfuse
        recognised as ``call_module`` nodes (dumps show them as in a ``Sequential`` program).
    fusions:
        One record per fusion (rule, covered ops, implementation).
    kind:
        ``"training"`` (AOTAutograd's joint forward+backward graph: fusions are made before the
        partitioner chooses what backward keeps) or ``"inference"``.
    phases:
        Fused node name -> ``"forward"`` or ``"backward"``.
    overlap_decisions:
        ``(wait node, explanation)`` of each collective left to NCCL because independent GEMMs can
        hide it (:mod:`.overlap`).
    seconds:
        Wall time opfuse spent on the graph (recognition, passes, lowering), in seconds.
    notes:
        ``(source, remark)`` pairs: what the passes, and recognition (``"torch_compile"``), left
        alone and why, beyond the rules' near misses.
    """

    def __init__(self, index: int, kind: str, graph_module: fx.GraphModule, unfused: fx.GraphModule, fusions: list,
                 phases: dict[str, str], notes, aten_nodes: int):
        super().__init__(None, graph_module, unfused, fusions, (), notes=notes)
        self.index = index
        self.kind = kind
        self.phases = dict(phases)
        self.aten_nodes = aten_nodes
        self.seconds = 0.0
        self.overlap_decisions: list[tuple[str, str]] = []

    def __call__(self, *inputs):
        raise TypeError("a GraphProgram describes a graph inside a torch.compile'd model; call the compiled model")

    def describe_inputs(self) -> str:
        return f"{self.kind} graph {self.index} ({self.aten_nodes} aten nodes)"

    def fusions_in(self, phase: str) -> list:
        """The fusion records of ``phase`` (``"forward"`` or ``"backward"``)."""
        if phase not in ("forward", "backward"):
            raise ValueError(f"GraphProgram.fusions_in: phase={phase!r}; accepted: 'forward', 'backward'")
        return [f for f in self.fusions if self.phases.get(f.fused_node) == phase]

    def explanation(self, verbose: bool = False) -> Explanation:
        """As for any program, plus one near miss per collective that no rule fused with a
        neighbour, however short the partial match: in a compiled model the question is usually
        "why did this all-reduce not fuse with the add after it?"."""
        result = explain_program(self, verbose)
        if verbose:
            return result
        shown = {(m.rule, tuple(m.matched)) for m in result.near_misses}
        fused_with_neighbours = {name for f in self.fusions if len(f.nodes) > 1 for name in f.nodes}
        best = {}
        order = {rule.name: i for i, rule in enumerate(rules())}
        misses = sorted(explain_program(self, verbose=True).near_misses, key=lambda m: order.get(m.rule, len(order)))
        for miss in misses:
            anchor, _, kind = miss.matched[0].partition(" ")
            if kind.strip("()") not in _COLLECTIVES or anchor in fused_with_neighbours or miss.total < 2:
                continue
            if (miss.rule, tuple(miss.matched)) in shown or miss.reason.startswith(("matches:", "shadowed")):
                continue
            if anchor not in best or len(miss.matched) > len(best[anchor].matched):
                best[anchor] = miss
        result.near_misses.extend(best.values())
        return result

    def __repr__(self) -> str:
        rules = ", ".join(f"{f.rule}({self.phases.get(f.fused_node, '?')})" for f in self.fusions) or "no fusions"
        return f"<opfuse.GraphProgram {self.describe_inputs()} fusions=[{rules}]>"
