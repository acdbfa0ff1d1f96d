"""``GraphProgram``: what opfuse did to one graph torch.compile handed it (a :class:`Program`, so
``fusions``, ``dump()`` and ``explain()`` work as for an ``ops.Sequential``)."""

from __future__ import annotations


from torch import fx

from ..core.explain import Explanation, explain_program, needs_fp8, uses_fp8
from ..core.program import Program
from ..core.rules import rules
from ..machinery.matcher import NearMiss, node_kind

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
        """As for any program, plus, for every collective that no rule fused with a neighbour, or
        that a smaller rule fused where a larger one got as far (the all-reduce and its bias, the
        add in the next graph), the reason in the terms of the plain rule that would have taken it
        (the longest partial match, however short): in a compiled model the question is usually
        "why did this all-reduce not fuse with the add after it?". A graph break, a dtype cast or
        an add that took the value as its residual is named. Rules that cannot apply where the
        collective is are not cited: FP8 rules in a program without FP8, rules made of
        forward-only ops (norms, activations, weight GEMMs) for a backward collective. A
        collective left unfused by every rule always gets a line."""
        result = explain_program(self, verbose)
        if verbose:
            return result
        shown = {(m.rule, tuple(m.matched)) for m in result.near_misses}
        result.near_misses.extend(m for m in _collective_misses(self) if (m.rule, tuple(m.matched)) not in shown)
        return result

    def __repr__(self) -> str:
        rules = ", ".join(f"{f.rule}({self.phases.get(f.fused_node, '?')})" for f in self.fusions) or "no fusions"
        return f"<opfuse.GraphProgram {self.describe_inputs()} fusions=[{rules}]>"


# Why a collective was left alone ------------------------------------------------------------------


def _backward_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes that depend on a tangent (an incoming gradient): the backward half of a joint graph."""
    backward: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
                a in backward for a in node.all_input_nodes):
            backward.add(node)
    return backward


def _required(rule) -> list[tuple[str, ...]]:
    return [spec.kinds for spec in rule.pattern.specs if not spec.optional]


def _applies(rule, kinds_present: set[str]) -> bool:
    """Every op ``rule`` requires has a kind present in this part of the graph."""
    return all(set(kinds) & kinds_present for kinds in _required(rule))


def _describe(node: fx.Node, kind: str) -> str:
    return f"{node.name} ({kind})"


def _dtype_name(node: fx.Node) -> str:
    meta = node.meta.get("opfuse_meta")
    return str(getattr(meta, "dtype", "?")).replace("torch.", "")


def _hints(values: list[fx.Node], kind_of, backward: bool) -> list[str]:
    """What the users of ``values`` (the collective, and the last op a partial match reached: the
    bias after it) say about why the chain stopped, in words a model's author acts on: a graph
    break, a dtype cast, an add that takes the value as its residual."""
    hints = []
    for node in dict.fromkeys(values):
        users = list(node.users)
        if not backward and any(u.op == "output" for u in users):
            hints.append(f"{node.name} is an output of this graph: what reads it next runs in another graph (a "
                         f"graph break between them, e.g. print() or .item(), or the end of the compiled function)")
        for user in users:
            if user.op == "call_function" and "convert_element_type" in str(user.target):
                src, dst = _dtype_name(node), _dtype_name(user)
                hints.append(f"{user.name} casts it from {src} to {dst} before it is used: the fused ops keep one "
                             f"dtype from the collective through the add and the norm (reduce in {dst}, or keep "
                             f"the residual in {src})")
            elif kind_of(user) == "AddExtraInput" and user.args and user.args[0] is not node:
                main = user.args[0]
                others = [u for u in users if u is not user]
                why = (f"; {node.name} is also used by {', '.join(_describe(u, kind_of(u)) for u in others)}"
                       if others else "")
                hints.append(f"{_describe(user, 'AddExtraInput')} adds it as its residual (argument 1); its main "
                             f"input is {_describe(main, kind_of(main))}{why}")
    return hints


def _neighbour_reason(gm, node: fx.Node, kind_of, variant, spec_name: str, covered) -> str | None:
    """Why ``node`` cannot be ``spec_name`` of ``variant``: its producer or consumers do not have
    the kinds the pattern connects it to (or were fused by another rule); ``None`` if they do."""
    for src, dst, arg in variant.edges:
        if dst == spec_name:
            want = variant.spec(src).kinds
            producer = node.args[arg] if arg < len(node.args) else None
            if not isinstance(producer, fx.Node) or kind_of(producer) not in want:
                found = _describe(producer, kind_of(producer)) if isinstance(producer, fx.Node) else "nothing"
                return f"expected {'|'.join(want)} before {node.name}, found {found}"
            if producer.name in covered:
                return f"its producer {_describe(producer, kind_of(producer))} was fused by {covered[producer.name]}"
        if src == spec_name:
            want = variant.spec(dst).kinds
            fitting = [u for u in node.users if kind_of(u) in want and arg < len(u.args) and u.args[arg] is node]
            if not fitting:
                found = ", ".join(sorted(_describe(u, kind_of(u)) for u in node.users)) or "nothing"
                return f"expected {'|'.join(want)} after {node.name}, found {found}"
            taken = [u for u in fitting if u.name in covered]
            if len(taken) == len(fitting):
                return f"{', '.join(_describe(u, kind_of(u)) for u in taken)} was fused by {covered[taken[0].name]}"
    return None


def _synthesised(gm, node: fx.Node, kind: str, candidates, kind_of, covered) -> NearMiss | None:
    """A near miss for a collective that no partial match of a rule contains (a reduce-scatter
    of something that is not a GEMM, an all-gather that feeds no GEMM)."""
    for rule in candidates:
        for variant in rule.variants:
            for spec in variant.specs:
                if kind not in spec.kinds:
                    continue
                reason = _neighbour_reason(gm, node, kind_of, variant, spec.name, covered)
                if reason is not None:
                    return NearMiss(rule.name, rule.source, rule.pattern.describe(), [_describe(node, kind)],
                                    len(rule.pattern.specs), reason)
    return None


def _collective_misses(program) -> list[NearMiss]:
    """One near miss per collective of ``program`` that no rule fused with a neighbour (see
    :meth:`GraphProgram.explanation`)."""
    gm = program.unfused_graph_module
    kinds = {node: node_kind(gm, node) for node in gm.graph.nodes}
    kind_of = lambda n: kinds.get(n, "?") if isinstance(n, fx.Node) else "constant"  # noqa: E731
    backward = _backward_nodes(gm)
    present_backward = {kinds[n] for n in backward}
    everywhere = set(kinds.values())
    fp8 = uses_fp8(gm)
    covered_by = {name: record for record in program.fusions for name in record.nodes}
    covered = {name: record.rule for name, record in covered_by.items()}
    all_rules = [r for r in rules() if fp8 or not needs_fp8(r)]
    order = {rule.name: i for i, rule in enumerate(all_rules)}
    misses_at: dict[str, list[NearMiss]] = {}
    for miss in explain_program(program, verbose=True).near_misses:
        if miss.rule not in order or miss.reason.startswith(("matches:", "shadowed")):
            continue
        for item in miss.matched:
            misses_at.setdefault(item.split(" ")[0], []).append(miss)
    found = []
    by_name = {n.name: n for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        kind = kinds[node]
        if kind not in _COLLECTIVES:
            continue
        record = covered_by.get(node.name)
        in_backward = node in backward
        # Rules that could take this collective here: they have its kind; for one a rule fused,
        # they were tried before that rule (a larger fusion: the all-reduce with the add and the
        # norm, not with the add alone) and got at least as far; for a backward collective, every
        # op they require occurs in the backward part of the graph (norms, activations and weight
        # GEMMs are recognised in the forward only). A forward collective is measured against
        # every such rule: a graph break may have put the add or the norm into the next graph.
        fused_by = _rule(all_rules, record.rule) if record is not None and record.rule in order else None
        candidates = [r for r in all_rules if any(kind in spec.kinds for spec in r.pattern.specs)
                      and (record is None or (fused_by is not None and r.priority > fused_by.priority))
                      and (not in_backward or _applies(r, present_backward))]
        names = {r.name for r in candidates}
        least = len(record.nodes) if record is not None else 0
        misses = [m for m in misses_at.get(node.name, ()) if m.rule in names and len(m.matched) >= least]
        if misses:
            # The longest partial match; among equals, a rule whose ops are all in this graph (its
            # LayerNorm form in a LayerNorm model), then the rules' order.
            best = min(misses, key=lambda m: (-len(m.matched), not _applies(_rule(all_rules, m.rule), everywhere),
                                              order[m.rule]))
            best = NearMiss(best.rule, best.source, best.variant, list(best.matched), best.total, best.reason,
                            best.expected)
        elif record is None:  # left unfused: always say why
            best = _synthesised(gm, node, kind, candidates, kind_of, covered) if candidates else None
            if best is None:
                phase = "backward" if in_backward else "forward"
                reason = (f"no rule with a {kind} applies in the {phase} part of this graph (the other ops they "
                          f"need are not there)" if not candidates else "no rule takes this collective here")
                best = NearMiss("(no rule)", "", kind, [_describe(node, kind)], 1, reason)
        else:
            continue  # fused, and no larger rule got as far here
        reached = by_name.get(best.matched[-1].split(" ")[0], node) if best.matched else node
        hints = _hints([node, reached], kind_of, in_backward)
        if hints:
            best.reason = "; ".join([best.reason, *hints])
        found.append(best)
    return found


def _rule(all_rules, name):
    return next(r for r in all_rules if r.name == name)

