"""Rendering program graphs: runnable Python, a text table and Graphviz dot (the interactive HTML
viewer lives in :mod:`opfuse.debug.html`).

``python`` output is valid Python (a ``forward(self, ...)`` function over the program's
submodules) with one line per node and a comment giving the value's dtype/shape, its sharding,
and for fused nodes the rule that made them (``file:line``) and the implementation chosen.
"""

from __future__ import annotations

import operator

from torch import fx

from ..ops.base import TensorMeta

__all__ = ["render", "render_python", "render_text", "render_dot", "python_line", "node_kind", "meta_text", "FORMATS"]

FORMATS = ("python", "text", "dot", "html")


def _meta_text(meta) -> str:
    if isinstance(meta, TensorMeta):
        return str(meta)
    if isinstance(meta, tuple):
        return "(" + ", ".join(_meta_text(m) for m in meta) + ")"
    return "?"


def meta_text(node: fx.Node) -> str:
    """dtype/shape/device of the value ``node`` produces; for the output node, of what it returns."""
    if node.op == "output":
        outs = node.args[0]
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        return _meta_text(tuple(o.meta.get("opfuse_meta") if isinstance(o, fx.Node) else None for o in outs))
    return _meta_text(node.meta.get("opfuse_meta"))


def node_kind(gm: fx.GraphModule, node: fx.Node) -> str:
    """What a node is: the op's kind (``AllReduceAddRMSNorm``), ``getitem [i]``, ``placeholder``,
    ``output``."""
    op = _op(gm, node)
    if op is not None:
        return getattr(op, "kind", type(op).__name__)
    if node.op == "call_function" and node.target is operator.getitem:
        return f"getitem [{node.args[1]}]"
    return node.op


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


def python_line(gm: fx.GraphModule, node: fx.Node) -> str:
    """The line ``render_python`` prints for ``node`` (without indentation): the call, then a
    comment with the value's meta, its sharding, and the rule / implementation of fused nodes."""
    if node.op == "placeholder":
        return f"# {node.name}: {_meta_text(node.meta.get('opfuse_meta'))} {_sharding(node)}".rstrip()
    if node.op == "output":
        return f"return {_arg_text(node.args[0])}"
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
    return f"{text}  # {detail}" + (f"; {comment}" if comment else "")


def render_python(gm: fx.GraphModule, title: str = "") -> str:
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    lines = []
    if title:
        lines.append(f"# {title}")
    lines.append("import operator  # noqa: F401  (getitem nodes)")
    lines.append("")
    lines.append(f"def forward(self, {', '.join(placeholders)}):")
    lines += ["    " + python_line(gm, node) for node in gm.graph.nodes]
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
