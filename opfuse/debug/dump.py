"""Rendering program graphs: runnable Python, a text table, Graphviz dot, and self-contained HTML.

``python`` output is valid Python (a ``forward(self, ...)`` function over the program's
submodules) with one line per node and a comment giving the value's dtype/shape, its sharding,
and for fused nodes the rule that made them (``file:line``) and the implementation chosen.
"""

from __future__ import annotations

import html
import operator

import networkx as nx
from torch import fx

from ..ops.base import TensorMeta

__all__ = ["render", "render_python", "render_text", "render_dot", "render_html", "FORMATS"]

FORMATS = ("python", "text", "dot", "html")


def _meta_text(meta) -> str:
    if isinstance(meta, TensorMeta):
        return str(meta)
    if isinstance(meta, tuple):
        return "(" + ", ".join(_meta_text(m) for m in meta) + ")"
    return "?"


def _op(gm: fx.GraphModule, node: fx.Node):
    return gm.get_submodule(node.target) if node.op == "call_module" else None


def _describe(gm: fx.GraphModule, node: fx.Node) -> str:
    op = _op(gm, node)
    if op is None:
        return ""
    return op.describe() if hasattr(op, "describe") else type(op).__name__


def _sharding(node: fx.Node) -> str:
    sharding = node.meta.get("opfuse_sharding")
    return sharding.describe() if sharding is not None else ""


def _arg_text(arg) -> str:
    if isinstance(arg, fx.Node):
        return arg.name
    if isinstance(arg, (tuple, list)):
        inner = ", ".join(_arg_text(a) for a in arg)
        return f"({inner},)" if isinstance(arg, tuple) and len(arg) == 1 else (f"({inner})" if isinstance(arg, tuple) else f"[{inner}]")
    return repr(arg)


def _fused_comment(node: fx.Node) -> str:
    rule = node.meta.get("opfuse_rule")
    if not rule:
        return ""
    covered = ", ".join(f"{name} ({kind})" for name, kind in node.meta.get("opfuse_covered", []))
    impl = node.meta.get("opfuse_impl", "?")
    return f"rule {rule} at {node.meta.get('opfuse_source')}; impl={impl}; covers {covered}"


def render_python(gm: fx.GraphModule, title: str = "") -> str:
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    lines = []
    if title:
        lines.append(f"# {title}")
    lines.append("import operator  # noqa: F401  (getitem nodes)")
    lines.append("")
    lines.append(f"def forward(self, {', '.join(placeholders)}):")
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            lines.append(f"    # {node.name}: {_meta_text(node.meta.get('opfuse_meta'))} {_sharding(node)}".rstrip())
            continue
        if node.op == "output":
            lines.append(f"    return {_arg_text(node.args[0])}")
            continue
        args = ", ".join(_arg_text(a) for a in node.args)
        if node.op == "call_module":
            target = node.target
            call = f"self.{target}" if target.isidentifier() else f"getattr(self, {target!r})"
            comment = _fused_comment(node) or _describe(gm, node)
            if node.meta.get("opfuse_rule"):
                comment = f"{_describe(gm, node)} <- {comment}"
            text = f"{node.name} = {call}({args})"
        elif node.op == "call_function" and node.target is operator.getitem:
            text = f"{node.name} = {_arg_text(node.args[0])}[{node.args[1]!r}]"
            comment = ""
        else:
            text = f"{node.name} = {node.target}({args})"
            comment = ""
        detail = f"{_meta_text(node.meta.get('opfuse_meta'))} {_sharding(node)}".strip()
        lines.append(f"    {text}  # {detail}" + (f"; {comment}" if comment else ""))
    return "\n".join(lines) + "\n"


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
        rows.append((node.name, kind, inputs, _meta_text(node.meta.get("opfuse_meta")), _sharding(node), detail))
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
        label = f"{node.name}\\n{kind}\\n{_meta_text(node.meta.get('opfuse_meta'))}"
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


def _svg(gm: fx.GraphModule) -> str:
    """A layered drawing of the graph (no Graphviz needed)."""
    graph = nx.DiGraph()
    for node in gm.graph.nodes:
        graph.add_node(node.name)
        for src in node.all_input_nodes:
            graph.add_edge(src.name, node.name)
    layers = list(nx.topological_generations(graph))
    box_w, box_h, gap_x, gap_y = 230, 46, 20, 34
    width = max(len(layer) for layer in layers) * (box_w + gap_x) + gap_x
    height = len(layers) * (box_h + gap_y) + gap_y
    position = {}
    nodes = {n.name: n for n in gm.graph.nodes}
    for row, layer in enumerate(layers):
        for col, name in enumerate(sorted(layer)):
            position[name] = (gap_x + col * (box_w + gap_x), gap_y + row * (box_h + gap_y))
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" font-size="11">']
    for a, b in graph.edges:
        (x1, y1), (x2, y2) = position[a], position[b]
        parts.append(f'<line x1="{x1 + box_w / 2}" y1="{y1 + box_h}" x2="{x2 + box_w / 2}" y2="{y2}" stroke="#666" marker-end="url(#arrow)"/>')
    parts.insert(1, '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="8" refY="4" orient="auto">'
                    '<path d="M0,0 L8,4 L0,8 z" fill="#666"/></marker></defs>')
    for name, (x, y) in position.items():
        node = nodes[name]
        op = _op(gm, node)
        kind = getattr(op, "kind", node.op) if op is not None else ("getitem" if node.op == "call_function" else node.op)
        fill = "#cde8ff" if node.meta.get("opfuse_rule") else ("#ffe3c2" if getattr(op, "is_collective", False) else "#f4f4f4")
        parts.append(f'<rect x="{x}" y="{y}" width="{box_w}" height="{box_h}" rx="6" fill="{fill}" stroke="#333"/>')
        parts.append(f'<text x="{x + 6}" y="{y + 16}">{html.escape(name)}</text>')
        parts.append(f'<text x="{x + 6}" y="{y + 32}">{html.escape(kind)} {html.escape(_meta_text(node.meta.get("opfuse_meta")))[:28]}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def render_html(gm: fx.GraphModule, title: str = "", before: fx.GraphModule | None = None,
                fusions=()) -> str:
    sections = [f"<h1>{html.escape(title or 'opfuse program')}</h1>"]
    if fusions:
        rows = "".join(
            f"<tr><td>{html.escape(f.fused_node)}</td><td>{html.escape(f.rule)}</td>"
            f"<td>{html.escape(', '.join(f.ops))}</td><td>{html.escape(str(f.impl))}</td>"
            f"<td>{html.escape(f.source)}</td></tr>" for f in fusions)
        sections.append("<h2>Fusions</h2><table border=1 cellpadding=4><tr><th>node</th><th>rule</th><th>ops</th>"
                        f"<th>impl</th><th>defined at</th></tr>{rows}</table>")
    graphs = ([("Before fusion", before)] if before is not None else []) + [("After fusion" if before is not None else "Graph", gm)]
    for heading, module in graphs:
        sections.append(f"<h2>{heading}</h2>{_svg(module)}<pre>{html.escape(render_python(module))}</pre>")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>"
            f"{html.escape(title or 'opfuse program')}</title></head><body>" + "\n".join(sections) + "</body></html>\n")


def render(fmt: str, gm: fx.GraphModule, title: str = "", before: fx.GraphModule | None = None, fusions=()) -> str:
    if fmt == "python":
        return render_python(gm, title)
    if fmt == "text":
        return render_text(gm, title)
    if fmt == "dot":
        return render_dot(gm, title, before)
    if fmt == "html":
        return render_html(gm, title, before, fusions)
    raise ValueError(f"dump: format {fmt!r}; accepted: {', '.join(FORMATS)}")
