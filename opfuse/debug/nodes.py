"""What a graph node is, in the words of the dumps: its value's meta text, its kind, sharding, the
rule that made it, and its line of runnable Python (``render_python`` prints one per node).
Shared by the text/dot dumps (:mod:`opfuse.debug.dump`) and the HTML viewer
(:mod:`opfuse.debug.html`).
"""

from __future__ import annotations

import operator

from torch import fx

from ..ops.base import TensorMeta

__all__ = ["meta_text", "node_kind", "python_line", "render_python"]


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
    by = node.meta.get("opfuse_by", "rule")  # a fusion rule, or a registered pass
    return f"{by} {rule} at {node.meta.get('opfuse_source')}; impl={impl}; covers {covered}"


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
