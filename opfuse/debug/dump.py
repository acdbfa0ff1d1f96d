"""Rendering program graphs: runnable Python, a text table and Graphviz dot (the interactive HTML
viewer lives in :mod:`opfuse.debug.html`).

``python`` output is valid Python (a ``forward(self, ...)`` function over the program's
submodules) with one line per node and a comment giving the value's dtype/shape, its sharding,
and for fused nodes the rule that made them (``file:line``) and the implementation chosen.
"""

from __future__ import annotations

import operator

from torch import fx

from .nodes import _arg_text, _describe, _fused_comment, _op, _sharding, meta_text, render_python  # noqa: F401 (render_python: re-exported)

__all__ = ["render", "render_python", "render_text", "render_dot", "FORMATS"]

FORMATS = ("python", "text", "dot", "html")


def render_text(gm: fx.GraphModule, title: str = "") -> str:
    rows = [("node", "kind", "inputs", "value", "sharding", "detail")]
    for node in gm.graph.nodes:
        if node.op == "output":
            rows.append(("output", "", _arg_text(node.args[0]), "", "", ""))
            continue
        kind = node.op if node.op != "call_module" else getattr(_op(gm, node), "kind", type(_op(gm, node)).__name__)
        if node.op == "call_function" and node.target is operator.getitem:
            kind = "getitem"
        inputs = ", ".join(_arg_text(a) for a in node.args) if node.op != "placeholder" else ""
        detail = _fused_comment(node) or _describe(gm, node)
        rows.append((node.name, kind, inputs, meta_text(node), _sharding(node), detail))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    out = [title] if title else []
    for i, row in enumerate(rows):
        out.append("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row[:5])) + "  " + row[5])
        if i == 0:
            out.append("  ".join("-" * w for w in widths) + "  " + "-" * 6)
    return "\n".join(line.rstrip() for line in out) + "\n"


def _dot_body(gm: fx.GraphModule, prefix: str) -> list[str]:
    lines = []
    for node in gm.graph.nodes:
        kind = node.op
        op = _op(gm, node)
        if op is not None:
            kind = getattr(op, "kind", type(op).__name__)
        elif node.op == "call_function" and node.target is operator.getitem:
            kind = f"[{node.args[1]}]"
        label = f"{node.name}\\n{kind}\\n{meta_text(node)}"
        style = ""
        if node.meta.get("opfuse_rule"):
            label += f"\\nrule {node.meta['opfuse_rule']}\\nimpl {node.meta.get('opfuse_impl', '?')}"
            style = ', style=filled, fillcolor="#cde8ff"'
        elif getattr(op, "is_collective", False):
            style = ', style=filled, fillcolor="#ffe3c2"'
        shape = "ellipse" if node.op in ("placeholder", "output") else "box"
        lines.append(f'  "{prefix}{node.name}" [label="{label}", shape={shape}{style}];')
    for node in gm.graph.nodes:
        for src in node.all_input_nodes:
            lines.append(f'  "{prefix}{src.name}" -> "{prefix}{node.name}";')
    return lines


def render_dot(gm: fx.GraphModule, title: str = "", before: fx.GraphModule | None = None) -> str:
    lines = ["digraph opfuse {", "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];']
    if title:
        lines.append(f'  label="{title}";')
    if before is not None:
        lines.append('  subgraph cluster_before { label="before fusion";')
        lines += ["  " + line for line in _dot_body(before, "before_")]
        lines.append("  }")
        lines.append('  subgraph cluster_after { label="after fusion";')
        lines += ["  " + line for line in _dot_body(gm, "after_")]
        lines.append("  }")
    else:
        lines += _dot_body(gm, "")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(fmt: str, gm: fx.GraphModule, title: str = "", before: fx.GraphModule | None = None, fusions=()) -> str:
    if fmt == "python":
        return render_python(gm, title)
    if fmt == "text":
        return render_text(gm, title)
    if fmt == "dot":
        return render_dot(gm, title, before)
    if fmt == "html":
        from .html import render_html  # its own module: layout, vendored script, viewer

        return render_html(gm, title, before, fusions)
    raise ValueError(f"dump: format {fmt!r}; accepted: {', '.join(FORMATS)}")
