"""What a pass sees besides the graph: :class:`PassContext` (tensor metadata, layouts, the fusion
records, notes for ``explain()``) and :class:`FusionRecord`, one fusion of a program."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Sequence

from torch import fx, nn

from ..ops.base import TensorMeta
from ..ops.sharding import REPLICATED, Sharding
from .rewrite import add_submodule

__all__ = ["FusionRecord", "PassContext"]


@dataclasses.dataclass
class FusionRecord:
    """One fusion in a program: the rule (or pass) that made it, the basic ops it covered, the
    implementation chosen.

    ``rule`` is the rule's or the pass's name (``by`` says which), ``source`` where it was
    defined (``file:line``), ``ops`` / ``nodes`` the kinds and graph names of the covered ops.
    """

    rule: str
    ops: tuple[str, ...]
    nodes: tuple[str, ...]
    impl: str | None
    source: str
    fused_node: str
    skipped: tuple[tuple[str, str], ...] = ()
    by: str = "rule"

    def __str__(self) -> str:
        covered = ", ".join(f"{n} ({k})" for n, k in zip(self.nodes, self.ops))
        origin = "pass " if self.by == "pass" else ""
        return f"{self.fused_node}: {origin}{self.rule} [{self.source}] covers {covered}; impl={self.impl}"


class PassContext:
    """Handed to every pass with the graph: ``fn(graph_module, ctx)``.

    Every value of the graph carries its :class:`~opfuse.ops.TensorMeta` and its
    :class:`~opfuse.ops.Sharding`; a pass reads them with :meth:`meta` / :meth:`sharding` and must
    annotate the nodes it adds (:meth:`annotate`): the verify step after each registered pass
    checks that every value has metadata agreeing with what its op computes from its inputs.
    A pass that fuses ops records it with :meth:`record_fusion` (shown in ``Program.fusions``,
    dumps and ``explain()`` with the pass's name and ``file:line``); :meth:`note` leaves a remark
    for ``explain()`` (e.g. why something was not fused).

    Attributes
    ----------
    graph_module:
        The program's ``fx.GraphModule`` (its submodules are the ops).
    fusions:
        The fusion records so far (rules and passes), in the order they were made.
    notes:
        ``(pass name, message)`` remarks, shown by ``explain()``.
    current:
        The pass running now (its ``name`` and ``source``).
    unfused:
        A copy of the graph after partitioning (and the FP8 pass), before fusion.
    recipe:
        The :mod:`opfuse.fp8` recipe the program is compiled for (``None``: no FP8).
    without_autograd:
        The fused ops run without autograd: torch.compile's aten graphs, whose backward (if any)
        is already traced into the graph. Forward-only fused ops may then be used, and a fused op
        may hand a value it covers to the backward as an extra output.
    joint_graph:
        The graph is a joint forward + backward graph (torch.compile training): implementations
        of fused ops whose backward in the graph follows their choice are chosen for training.
    """

    def __init__(self, graph_module: fx.GraphModule | None = None, recipe=None, without_autograd: bool = False,
                 joint_graph: bool = False):
        self.graph_module = graph_module
        self.recipe = recipe
        self.without_autograd = bool(without_autograd)
        self.joint_graph = bool(joint_graph)
        self.fusions: list[FusionRecord] = []
        self.notes: list[tuple[str, str]] = []
        self.current = None
        self.unfused: fx.GraphModule | None = None

    # Reading -----------------------------------------------------------------------------

    def op(self, node: fx.Node) -> nn.Module | None:
        """The module a ``call_module`` node runs (an opfuse op or fused op), else ``None``."""
        if node.op != "call_module":
            return None
        return self.graph_module.get_submodule(node.target)

    def kind(self, node: fx.Node) -> str:
        """What rules match on: the op's kind, ``getitem``, or the node's fx opcode."""
        op = self.op(node)
        if op is not None:
            return getattr(op, "kind", type(op).__name__)
        if node.op == "call_function" and node.target is operator.getitem:
            return "getitem"
        return node.op

    def meta(self, node: fx.Node) -> TensorMeta | tuple | None:
        """The value's :class:`~opfuse.ops.TensorMeta` (a tuple for multi-output nodes); graphs
        traced by torch.compile without opfuse metadata fall back to their fake value."""
        meta = node.meta.get("opfuse_meta")
        if meta is None and "val" in node.meta:
            val = node.meta["val"]
            if hasattr(val, "shape") and hasattr(val, "dtype"):
                meta = TensorMeta(tuple(val.shape), val.dtype, val.device, bool(getattr(val, "requires_grad", False)))
        return meta

    def sharding(self, node: fx.Node) -> Sharding:
        """The value's tensor-parallel layout (replicated when none is recorded)."""
        return node.meta.get("opfuse_sharding") or REPLICATED

    # Writing -----------------------------------------------------------------------------

    def annotate(self, node: fx.Node, meta: TensorMeta | tuple, sharding: Sharding | None = None) -> None:
        """Set a new node's metadata and layout (the layout defaults to replicated)."""
        node.meta["opfuse_meta"] = meta
        node.meta["opfuse_sharding"] = sharding if sharding is not None else REPLICATED

    def add_module(self, base: str, module: nn.Module) -> str:
        """Register ``module`` on the program under a fresh name derived from ``base``; returns the
        name to use as a ``call_module`` target."""
        return add_submodule(self.graph_module, base, module)

    def record_fusion(self, node: fx.Node, covered: Sequence[fx.Node], *, impl: str | None = None) -> FusionRecord:
        """Record that ``node`` replaces ``covered`` (call it before ``covered`` are erased, so their
        kinds can be read). The record carries the running pass's name and ``file:line``; the
        implementation is filled in when the program selects one (fused ops)."""
        if self.current is None:
            raise RuntimeError("PassContext.record_fusion: called outside a pass")
        kinds = tuple(self.kind(n) for n in covered)
        names = tuple(n.name for n in covered)
        node.meta["opfuse_rule"] = self.current.name
        node.meta["opfuse_source"] = self.current.source
        node.meta["opfuse_by"] = "pass"
        node.meta["opfuse_covered"] = list(zip(names, kinds))
        record = FusionRecord(rule=self.current.name, ops=kinds, nodes=names, impl=impl, source=self.current.source,
                              fused_node=node.name, by="pass")
        self.fusions.append(record)
        return record

    def note(self, message: str) -> None:
        """A remark from the running pass, shown by ``explain()`` under ``pass notes``."""
        self.notes.append((self.current.name if self.current is not None else "?", str(message)))

    def describe(self, value: Any) -> str:
        """``name (Kind)`` of a node, for messages."""
        return f"{value.name} ({self.kind(value)})" if isinstance(value, fx.Node) else repr(value)
