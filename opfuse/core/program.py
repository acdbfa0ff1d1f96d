"""``Program``: a compiled block — its executable graph, its fusions, dumps and explanations."""

from __future__ import annotations

import operator
from typing import Callable, Sequence

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
        One :class:`~opfuse.machinery.context.FusionRecord` per fusion: ``rule``, ``ops`` (kinds of
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
        single = getattr(module, "num_extra_outputs", 0) == 0
        #: The program as one Python function of the inputs (what a call runs).
        self.run = straight_line(graph_module, single)
        #: A check of the inputs before each call (``opfuse.config.check_replicated="always"``), or None.
        self.check_call = None

    def __call__(self, *inputs):
        return self.run(*inputs)

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
        from .explain import explain_program

        return explain_program(self, verbose)

    def explain(self, verbose: bool = False) -> str:
        """Fusions made, and near misses: rules that matched partly, how far, and what failed.

        ``verbose=True`` also lists one-op partial matches and partial matches over ops that
        other rules fused."""
        from .explain import format_explanation

        return format_explanation(self, self.explanation(verbose))

    def __repr__(self) -> str:
        rules = ", ".join(f.rule for f in self.fusions) or "no fusions"
        return f"<opfuse.Program inputs=({self.describe_inputs()}) fusions=[{rules}]>"


def straight_line(gm: fx.GraphModule, single: bool) -> Callable:
    """``gm``'s graph as one function with its modules bound as constants: a call costs the
    module calls themselves (hooks included), without the GraphModule's wrapper and attribute
    lookups. ``single``: return the first output alone. Graphs with nodes other than modules
    and ``getitem`` run through ``gm.forward``."""
    names: dict[fx.Node, str] = {}
    constants: dict[str, object] = {}
    params, lines, result = [], [], None
    for node in gm.graph.nodes:
        name = names[node] = f"v{len(names)}"

        def ref(arg):
            if isinstance(arg, fx.Node):
                return names[arg]
            if isinstance(arg, (tuple, list)):
                inner = ", ".join(ref(a) for a in arg)
                if isinstance(arg, tuple):
                    return f"({inner},)" if arg else "()"
                return f"[{inner}]"
            if arg is None or isinstance(arg, (bool, int, float, str)):
                return repr(arg)
            raise TypeError(arg)

        try:
            if node.op == "placeholder":
                params.append(name)
            elif node.op == "call_module" and not node.kwargs:
                constants[f"m_{name}"] = gm.get_submodule(node.target)
                lines.append(f"{name} = m_{name}({', '.join(ref(a) for a in node.args)})")
            elif node.op == "call_function" and node.target is operator.getitem and not node.kwargs:
                lines.append(f"{name} = {ref(node.args[0])}[{ref(node.args[1])}]")
            elif node.op == "output":
                outputs = node.args[0]
                # A graph may return nothing (a torch.compile graph that only computes sizes).
                result = ref(outputs[0]) if single and len(outputs) else ref(tuple(outputs))
            else:
                raise TypeError(node.op)
        except TypeError:
            forward = gm.forward
            return (lambda *inputs: forward(*inputs)[0]) if single else (lambda *inputs: tuple(forward(*inputs)))
    source = f"def program({', '.join(params)}):\n" + "".join(f"    {line}\n" for line in lines) + f"    return {result}\n"
    exec(compile(source, "<opfuse program>", "exec"), constants)  # noqa: S102 - generated from our own graph
    run = constants["program"]
    run.source = source
    return run
