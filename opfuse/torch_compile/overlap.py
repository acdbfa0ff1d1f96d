"""Collectives that stay with NCCL because independent GEMMs can hide them, and the graph order
that lets them.

A fused all-reduce kernel runs in line on the compute stream: it is faster than NCCL's, but
nothing else runs while it does. NCCL's runs on its own stream, so every GEMM issued between the
collective and the first use of its result runs under it. In a training graph the reduction of a
layer's input gradient has such GEMMs (the same layer's weight gradients, which do not depend on
it): the all-reduce of a column-parallel layer's input gradient (tensor parallelism), the
reduce-scatter of an all-gathered input's gradient (sequence parallelism). Taking it off NCCL's
stream would expose it, and leaving it in line (where it was traced, after the weight gradients)
wastes the overlap too. So before recognition, :func:`plan_overlaps` weighs each summing
all-reduce and reduce-scatter: the GEMM work in its window (from the previous collective to the
first use of its result) that neither feeds it nor depends on it, against what moving its bytes
costs. Where that work can hide it, the collective is left to NCCL and
:func:`schedule_overlaps` orders the graph so that it does: the collective is issued as soon as
its input exists (the independent nodes before it move after it) and its wait moves to just before
the first use of its result. ``explain()`` lists each decision.

A forward collective whose result the next GEMM reads at once (the all-gather of a
sequence-parallel layer's input) has no GEMM to hide under, but the work that reads only weights
(FP8 weight quantization: a full read of every weight per step) does not depend on it:
:func:`fill_with_weight_work` moves that work from after the wait to between issue and wait, so
the weights are cast while the activations travel.

A backward collective that feeds the GEMM right after it (the all-gather of a sequence-parallel
output's gradient, which the row-parallel layer's data and weight gradients read) has nothing of
its own to hide under, while the reduction before it often has more weight-gradient GEMMs under
it than it needs. :func:`defer_weight_gradients` moves such a GEMM (one whose result goes only
to the graph's outputs, a parameter's gradient) from before the exposed collective to under it,
taking it from a window that keeps another GEMM, or from outside any window.

The cost model is a ratio, not a timing: a reduction of ``B`` input bytes costs about as much as
``FLOPS_PER_BYTE * (B + LATENCY_BYTES)`` GEMM FLOPs (H100/H200: ~750 bf16 TFLOP/s against ~150 GB/s
of all-reduce algorithm bandwidth, ~15 us of latency; a reduce-scatter moves half an all-reduce's
bytes, so the same ratio is conservative for it), and is left to NCCL when the independent GEMMs
hold at least ``HIDE_FRACTION`` of that. The GEMMs are counted before the FP8 pass: one that
becomes an FP8 GEMM hides about half as long, and the threshold is not adjusted for it (the backward
reduce-scatter has no fused alternative, so leaving it to NCCL costs nothing even then).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools

from torch import fx

from ..machinery.aten import aten, c10d, calls, shape, value

__all__ = ["Overlap", "plan_overlaps", "schedule_overlaps", "fill_with_weight_work", "defer_weight_gradients",
           "backward_nodes", "summing_reductions", "issued_collectives", "is_collective", "weight_only",
           "FLOPS_PER_BYTE",
           "LATENCY_BYTES", "HIDE_FRACTION"]

FLOPS_PER_BYTE = 5000
LATENCY_BYTES = 2 << 20
HIDE_FRACTION = 0.5

_GEMMS = (aten.mm, aten.addmm, aten.bmm)
_ISSUES = (c10d.all_reduce, c10d.all_gather_into_tensor, c10d.reduce_scatter_tensor)
_REDUCTIONS = (c10d.all_reduce.default, c10d.reduce_scatter_tensor.default)
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd")


@dataclasses.dataclass(eq=False)
class Overlap:
    """A reduction left to NCCL: its issue and wait nodes, and the GEMMs that can run under it."""

    issue: fx.Node
    wait: fx.Node
    gemms: list[fx.Node]
    message_bytes: int
    gemm_flops: int

    def describe(self) -> str:
        names = ", ".join(g.name for g in self.gemms[:4]) + (", ..." if len(self.gemms) > 4 else "")
        kind = "reduce-scatter" if calls(self.issue, c10d.reduce_scatter_tensor) else "all-reduce"
        return (f"{self.wait.name}: {kind} of {self.message_bytes / 2**20:.2f} MiB left to NCCL (asynchronous): "
                f"{len(self.gemms)} independent GEMM(s) ({self.gemm_flops / 1e9:.3g} GFLOP: {names}) between its "
                f"input and the first use of its result can hide it; scheduled to run under it "
                f"(OPFUSE_OVERLAP_COLLECTIVES=fuse fuses it instead)")


def _nbytes(node) -> int:
    val = value(node)
    return val.numel() * val.element_size() if hasattr(val, "numel") else 0


def _flops(node) -> int:
    a = shape(node.args[1] if calls(node, aten.addmm) else node.args[0])
    b = shape(node.args[2] if calls(node, aten.addmm) else node.args[1])
    if a is None or b is None:
        return 0
    if calls(node, aten.bmm):
        return 2 * a[0] * a[1] * a[2] * b[2]
    return 2 * a[0] * a[1] * b[1]


def _reachable(node: fx.Node, step, within=None) -> set[fx.Node]:
    """Every node reachable from ``node`` (excluded) through ``step(n)``: its inputs or its users;
    with ``within(n)``, only through nodes it accepts (a window of the graph: every path between
    two nodes of a window stays inside it, the graph being in order)."""
    seen, stack = set(), list(step(node))
    while stack:
        current = stack.pop()
        if current not in seen and (within is None or within(current)):
            seen.add(current)
            stack.extend(step(current))
    return seen


def _ancestors(node: fx.Node, within=None) -> set[fx.Node]:
    return _reachable(node, lambda n: n.all_input_nodes, within)


def _descendants(node: fx.Node, within=None) -> set[fx.Node]:
    return _reachable(node, lambda n: n.users, within)


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes of a joint graph that depend on an incoming gradient (AOTAutograd's ``tangents_*``):
    the backward, which the partitioner separates from the forward; nothing moves across."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" and node.name.startswith("tangents"):
            found.add(node)
        elif any(arg in found for arg in node.all_input_nodes):
            found.add(node)
    return found


def summing_reductions(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """``(issue, wait)`` of every summing all-reduce and reduce-scatter whose issue only its wait
    reads."""
    found = []
    for node in graph.nodes:
        if calls(node, c10d.wait_tensor.default) and node.args and calls(node.args[0], *_REDUCTIONS):
            issue = node.args[0]
            if len(issue.users) == 1 and issue.args[1] == "sum":
                found.append((issue, node))
    return found


def _collective_positions(graph: fx.Graph, order: dict) -> list[int]:
    """The positions (``order``) of every collective issue and wait, ascending."""
    return [order[n] for n in graph.nodes if calls(n, *_ISSUES) or calls(n, c10d.wait_tensor.default)]


def _window(positions: list[int], issue: fx.Node, wait: fx.Node, order: dict) -> tuple[int, int]:
    """Positions ``(after the previous collective, at the first use of wait's result)``
    (``positions``: :func:`_collective_positions`)."""
    before = bisect.bisect_left(positions, order[issue])
    start = positions[before - 1] if before else -1
    users = [order[u] for u in wait.users]
    return start, min(users) if users else len(order)


def plan_overlaps(graph: fx.Graph) -> list[Overlap]:
    """The reductions of ``graph`` to leave to NCCL (see the module docstring)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    nodes = list(graph.nodes)
    positions = _collective_positions(graph, order)
    backward = backward_nodes(graph)
    found = []
    for issue, wait in summing_reductions(graph):
        start, stop = _window(positions, issue, wait, order)
        feeding = _ancestors(issue, lambda n, start=start: order[n] > start)
        fed = _descendants(wait, lambda n, stop=stop: order.get(n, stop) < stop)
        phase = issue in backward
        gemms = [n for n in nodes[start + 1:stop] if calls(n, *_GEMMS) and n not in feeding and n not in fed
                 and (n in backward) == phase]
        message = _nbytes(issue.args[0])
        flops = sum(_flops(g) for g in gemms)
        if gemms and flops >= HIDE_FRACTION * FLOPS_PER_BYTE * (message + LATENCY_BYTES):
            found.append(Overlap(issue, wait, gemms, message, flops))
    return found


def schedule_overlaps(graph: fx.Graph, overlaps: list[Overlap]) -> None:
    """Issue each overlap's collective as soon as its input exists (the nodes of its window that do
    not feed it move after it, in their order) and wait for it just before its result is used."""
    backward = backward_nodes(graph)
    for overlap in overlaps:
        issue, wait = overlap.issue, overlap.wait
        order = {node: i for i, node in enumerate(graph.nodes)}
        start, _ = _window(_collective_positions(graph, order), issue, wait, order)
        feeding = _ancestors(issue, lambda n, start=start: order[n] > start)
        phase = issue in backward
        movable = [n for n in graph.nodes if start < order[n] < order[issue] and n not in feeding
                   and n.op == "call_function" and (n in backward) == phase]
        anchor = issue
        for node in movable:
            anchor.append(node)
            anchor = node
        users = sorted(wait.users, key=lambda u: order.get(u, len(order)))
        if users:
            users[0].prepend(wait)
    graph.lint()


def issued_collectives(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """``(issue, wait)`` of every collective whose issue only its wait reads, in graph order."""
    return [(node.args[0], node) for node in graph.nodes
            if calls(node, c10d.wait_tensor.default) and node.args and calls(node.args[0], *_ISSUES)
            and len(node.args[0].users) == 1]


def weight_only(graph: fx.Graph, is_weight) -> set[fx.Node]:
    """The computations that read nothing but weights (``is_weight(placeholder)``), directly or
    through other such computations; side-effecting nodes, nodes without inputs and collectives
    (an FSDP parameter all-gather reads only weights too, but its place in the collective order is
    not this pass's to change) excluded."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        inputs = node.all_input_nodes
        if node.op != "call_function" or not inputs or node.is_impure() or is_collective(node):
            continue
        if all(n in found or (n.op == "placeholder" and is_weight(n)) for n in inputs):
            found.add(node)
    return found


def fill_with_weight_work(graph: fx.Graph, is_weight) -> list[str]:
    """Move the weight-only work that follows each forward collective (up to the next one) to
    between its issue and its wait (see the module docstring); ``is_weight(placeholder)`` says
    which graph inputs are parameters. Returns a line per collective that got work, for
    ``explain()``."""
    backward = backward_nodes(graph)
    weight_work = weight_only(graph, is_weight)
    pairs = [(issue, wait) for issue, wait in issued_collectives(graph) if issue not in backward]
    notes = []
    for issue, wait in pairs:
        moved = []
        # Only work whose inputs all come before the wait moves there (a graph input placed after a
        # collective that the lowering emitted among the placeholders stays where it is, and so
        # does the work reading it).
        order = {n: i for i, n in enumerate(graph.nodes)}
        ready = set()
        node = wait.next
        while node.op != "output" and not calls(node, *_ISSUES) and node not in backward:
            following = node.next
            if node in weight_work and node.op != "placeholder" and all(
                    a in ready or order[a] < order[wait] for a in node.all_input_nodes):
                wait.prepend(node)
                moved.append(node)
                ready.add(node)
            node = following
        work = [n for n in moved if n.op == "call_function" and not _is_view(n)]
        if work:
            names = ", ".join(_short(n) for n in work[:3]) + (", ..." if len(work) > 3 else "")
            notes.append(f"{wait.name}: {len(work)} weight-only op(s) ({names}) moved between the collective and its "
                         f"wait, to run while it moves the activations (OPFUSE_OVERLAP_COLLECTIVES=fuse keeps "
                         f"the traced order)")
    if notes:
        graph.lint()
    return notes


#: GEMMs as they stand after the lowering (FP8 GEMMs are ``_scaled_mm``; the SM-carveout pass runs later).
_LOWERED_GEMMS = (*_GEMMS, aten._scaled_mm)


def _is_gemm(node: fx.Node) -> bool:
    return calls(node, *_LOWERED_GEMMS)


def _gradient_sink(node: fx.Node, output: fx.Node) -> list[fx.Node] | None:
    """The nodes between GEMM ``node`` and the graph's output when its result reaches nothing else
    (no GEMM, collective or side effect on the way: a parameter's gradient, maybe reshaped or
    cast), else ``None``."""
    below = _descendants(node)
    if output not in below:
        return None
    chain = [n for n in below if n is not output]
    if any(_is_gemm(n) or is_collective(n) or n.is_impure() for n in chain):
        return None
    return chain


def defer_weight_gradients(graph: fx.Graph) -> list[str]:
    """Give each backward collective with no GEMM between its issue and its wait a weight-gradient
    GEMM from before it (see the module docstring); returns a line per move, for ``explain()``."""
    backward = backward_nodes(graph)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    notes = []
    # The moves below only reorder nodes: the pairs and which nodes are GEMMs stay.
    pairs = issued_collectives(graph)
    is_gemm = {n: _is_gemm(n) for n in graph.nodes}
    nodes = order = gemms_before = None

    def gemms_between(a: int, b: int) -> int:
        """GEMMs strictly between positions ``a`` and ``b`` of the current order."""
        return gemms_before[b] - gemms_before[a + 1]

    for issue, wait in [pair for pair in pairs if pair[0] in backward]:
        if nodes is None:  # the graph's order, again after a move
            nodes = list(graph.nodes)
            order = {node: i for i, node in enumerate(nodes)}
            gemms_before = list(itertools.accumulate((is_gemm[n] for n in nodes), initial=0))
        if gemms_between(order[issue], order[wait]):
            continue
        gemms_under = [(order[i], order[w], gemms_between(order[i], order[w])) for i, w in pairs]
        taken, chain = None, None
        for node in reversed(nodes[:order[issue]]):
            if node not in backward or not is_gemm[node]:
                continue
            if any(a < order[node] < b and count < 2 for a, b, count in gemms_under):
                continue  # the only GEMM under another collective: it stays
            chain = _gradient_sink(node, output)
            if chain is not None:
                taken = node
                break
        if taken is None:
            continue
        for node in sorted([taken] + [n for n in chain if order[n] < order[wait]], key=order.__getitem__):
            wait.prepend(node)
        nodes = None
        notes.append(f"{wait.name}: weight-gradient GEMM {taken.name} moved under this backward collective, which "
                     f"had no work of its own (OPFUSE_OVERLAP_COLLECTIVES=fuse keeps the traced order)")
    if notes:
        graph.lint()
    return notes


def is_collective(node: fx.Node) -> bool:
    """``node`` calls a functional collective (``_c10d_functional``, or its autograd variant
    ``_c10d_functional_autograd``) or waits for one."""
    return getattr(node.target, "namespace", None) in _COLLECTIVE_NAMESPACES or calls(node, *_ISSUES)


def _is_view(node: fx.Node) -> bool:
    return calls(node, aten.view, aten.permute, aten.t, aten.reshape, aten.expand, aten.alias, aten._unsafe_view)


def _short(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", str(target)).split(".")[0]
