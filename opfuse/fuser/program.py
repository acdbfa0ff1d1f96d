"""``Program``: a compiled block — its executable graph, its fusions, dumps and explanations."""

from __future__ import annotations

from typing import Sequence

from torch import fx

from ..debug.dump import FORMATS, render
from ..ops.base import TensorMeta

__all__ = ["Program"]


class Program:
    """The result of compiling an ``ops.Sequential`` for one input signature.

    Attributes
    ----------
    graph_module:
        The executable ``torch.fx.GraphModule`` (fused ops are ``torch.library`` custom ops).
    fusions:
        One :class:`~opfuse.passes.fusion.FusionRecord` per fusion: ``rule``, ``ops`` (kinds of
        the covered basic ops), ``nodes`` (their graph names), ``impl`` (implementation chosen).
    unfused_graph_module:
        The graph after partitioning, before fusion (shares the block's parameters).
    notes:
        ``(pass name, remark)`` pairs the passes left (e.g. why two GEMMs were not merged); shown
        by :meth:`explain`.
    """

    def __init__(self, module, graph_module: fx.GraphModule, unfused: fx.GraphModule, fusions: list,
                 input_metas: Sequence[TensorMeta], notes: Sequence[tuple[str, str]] = ()):
        self.module = module
        self.graph_module = graph_module
        self.unfused_graph_module = unfused
        self.fusions = fusions
        self.input_metas = tuple(input_metas)
        self.notes = list(notes)
        self._single = getattr(module, "num_extra_outputs", 0) == 0

    def __call__(self, *inputs):
        out = self.graph_module(*inputs)
        return out[0] if self._single else tuple(out)

    def describe_inputs(self) -> str:
        return ", ".join(str(m) for m in self.input_metas)

    def dump(self, fmt: str = "python", graph: str = "fused") -> str:
        """Render the program: ``fmt`` in ``python | text | dot | html``; ``graph`` is ``"fused"``,
        ``"unfused"`` (after partitioning, before fusion) or ``"both"`` (dot/html draw both; python
        and text print both one after the other)."""
        if fmt not in FORMATS:
            raise ValueError(f"Program.dump: format {fmt!r}; accepted: {', '.join(FORMATS)}")
        if graph not in ("fused", "unfused", "both"):
            raise ValueError(f"Program.dump: graph={graph!r}; accepted: 'fused', 'unfused', 'both'")
        title = f"opfuse program for inputs {self.describe_inputs()}"
        if graph == "unfused":
            return render(fmt, self.unfused_graph_module, title + " (before fusion)")
        if graph == "fused" or fmt in ("dot", "html"):
            before = self.unfused_graph_module if graph == "both" else None
            return render(fmt, self.graph_module, title, before=before, fusions=self.fusions)
        return (render(fmt, self.unfused_graph_module, title + " (before fusion)") + "\n"
                + render(fmt, self.graph_module, title + " (after fusion)"))

    def explanation(self, verbose: bool = False):
        from ..debug.explain import explain_program

        return explain_program(self, verbose)

    def explain(self, verbose: bool = False) -> str:
        """Fusions made, and near misses: rules that matched partly, how far, and what failed.

        ``verbose=True`` also lists one-op partial matches and partial matches over ops that
        other rules fused."""
        from ..debug.explain import format_explanation

        return format_explanation(self, self.explanation(verbose))

    def __repr__(self) -> str:
        rules = ", ".join(f.rule for f in self.fusions) or "no fusions"
        return f"<opfuse.Program inputs=({self.describe_inputs()}) fusions=[{rules}]>"
