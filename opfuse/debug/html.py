"""``Program.dump("html")``: one self-contained, offline HTML page that draws a program's graphs
(before and after fusion side by side) with a real graph layout.

Layout: Graphviz (``dot``, when installed; ``OPFUSE_DOT=/path/to/dot``, or ``none`` to skip it)
lays the graph out and routes its edges as splines around the nodes; without it the page carries
the vendored dagre library (``vendor/dagre.min.js``, MIT) and lays the graph out in the browser,
with node boxes sized from the text the browser measures. Either way the page has no external reference.

The viewer script (``viewer.js``, ``viewer.css`` beside this file) draws boxes and edges, ends
every edge at an input port on the target's top side (ports ordered by their producers' position
so edges need not cross, each numbered with the argument it feeds), shows a
node's Python line, value, sharding, rule (``file:line``) and implementation on hover or click,
highlights its producers and consumers, and pans (drag) and zooms (wheel; double-click fits).
"""

from __future__ import annotations

import html
import json
import os
import shutil
import subprocess

from torch import fx

from .nodes import _describe, _op, _sharding, meta_text, node_kind, python_line, render_python

__all__ = ["render_html", "graph_data", "graphviz_layout", "find_dot"]

HERE = os.path.dirname(os.path.abspath(__file__))
#: Box geometry shared with viewer.js (pixels; 11px monospace text).
FONT_PX, LINE_PX, PAD_X, PAD_Y, PORT_BAND = 11, 15, 8, 6, 10
#: Graphviz cannot measure the browser's font: an upper bound of a monospace glyph at 11px
#: (DejaVu Sans Mono and Liberation Mono are 6.6 px) keeps the text inside its box.
GRAPHVIZ_CHAR_PX = 7.2


def _node_class(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    if node.meta.get("opfuse_rule"):
        return "fused"
    if getattr(_op(gm, node), "is_collective", False):
        return "collective"
    if node.op == "call_function":
        return "getitem"
    return "op"


def _node_info(gm: fx.GraphModule, node: fx.Node) -> dict:
    info = {"python": python_line(gm, node), "value": meta_text(node)}
    if _sharding(node):
        info["sharding"] = _sharding(node)
    if node.meta.get("opfuse_rule"):
        origin = "pass " if node.meta.get("opfuse_by") == "pass" else ""  # a registered pass, not a rule
        info["rule"] = f"{origin}{node.meta['opfuse_rule']} at {node.meta.get('opfuse_source')}"
        info["implementation"] = str(node.meta.get("opfuse_impl", "?"))
        info["covers"] = ", ".join(f"{name} ({kind})" for name, kind in node.meta.get("opfuse_covered", []))
    described = _describe(gm, node)
    if described:
        info["module"] = described
    return info


def graph_data(gm: fx.GraphModule, title: str) -> dict:
    """The drawing's content: nodes (id, text lines, class, details, input-port count) and edges
    (source, target, the target's input port), in graph order."""
    nodes, edges = [], []
    for node in gm.graph.nodes:
        inputs = list(dict.fromkeys(node.all_input_nodes))  # one port per distinct producer
        lines = [node.name, node_kind(gm, node), meta_text(node)]
        if node.meta.get("opfuse_rule"):
            lines.append(f"impl={node.meta.get('opfuse_impl', '?')}")
        elif _sharding(node) and _sharding(node) != "replicated":
            lines.append(_sharding(node))
        nodes.append({"id": node.name, "lines": lines, "cls": _node_class(gm, node),
                      "ports": len(inputs), "info": _node_info(gm, node)})
        for port, src in enumerate(inputs):
            edges.append({"src": src.name, "dst": node.name, "port": port})
    return {"title": title, "nodes": nodes, "edges": edges}


def node_size(node: dict, char_px: float) -> tuple[float, float]:
    """Box size for ``node``'s lines at ``char_px`` per character (what viewer.js computes from
    measured text; here for Graphviz)."""
    width = max(len(line) for line in node["lines"]) * char_px + 2 * PAD_X
    height = len(node["lines"]) * LINE_PX + 2 * PAD_Y + (PORT_BAND if node["ports"] > 1 else 0)
    return round(width, 1), float(height)


def find_dot() -> str | None:
    """The Graphviz ``dot`` executable, or None. ``OPFUSE_DOT`` names another one, or ``none``
    to lay the page out with dagre even where Graphviz is installed."""
    chosen = os.environ.get("OPFUSE_DOT", "")
    if chosen.lower() == "none":
        return None
    return chosen or shutil.which("dot")


def _dot_source(data: dict) -> str:
    lines = ["digraph g {", "  rankdir=TB; nodesep=0.35; ranksep=0.45; splines=spline;",
             "  node [shape=box, fixedsize=true, label=\"\"];"]
    for node in data["nodes"]:
        width, height = node_size(node, GRAPHVIZ_CHAR_PX)
        lines.append(f'  "{node["id"]}" [width={width / 72:.4f}, height={height / 72:.4f}];')
    for edge in data["edges"]:
        lines.append(f'  "{edge["src"]}" -> "{edge["dst"]}";')
    lines.append("}")
    return "\n".join(lines)


def _points(text: str) -> list[list[float]]:
    return [[float(v) for v in p.split(",")] for p in text.split()]


def graphviz_layout(data: dict, dot: str | None = None, timeout: float = 30.0) -> dict | None:
    """Lay ``data`` out with Graphviz (``dot -Tjson``): node centres and sizes, and each edge as
    cubic Bezier control points ending in the arrow tip, in pixels with y pointing down. None when
    ``dot`` is missing or fails (the page then lays itself out with dagre)."""
    dot = dot or find_dot()
    if dot is None:
        return None
    try:
        result = subprocess.run([dot, "-Tjson"], input=_dot_source(data), capture_output=True, text=True,
                                timeout=timeout, check=True)
        laid = json.loads(result.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    height = float(laid["bb"].split(",")[3])
    flip = lambda p: [round(p[0], 2), round(height - p[1], 2)]  # noqa: E731 - Graphviz's y points up
    nodes, names = {}, {}
    for obj in laid.get("objects", []):
        names[obj["_gvid"]] = obj["name"]
        x, y = (float(v) for v in obj["pos"].split(","))
        nodes[obj["name"]] = {"x": round(x, 2), "y": round(height - y, 2),
                              "w": float(obj["width"]) * 72, "h": float(obj["height"]) * 72}
    routes = {}
    for edge in laid.get("edges", []):
        parts = edge["pos"].split()
        tip = None
        if parts[0].startswith("e,"):
            tip = flip(_points(parts.pop(0)[2:])[0])
        if parts and parts[0].startswith("s,"):
            parts.pop(0)
        points = [flip(p) for p in _points(" ".join(parts))]
        routes[(names[edge["tail"]], names[edge["head"]])] = {"bezier": points, "tip": tip}
    # Graphviz lists edges in its own order: give them back in ours (one edge per node pair).
    edges = [routes[(edge["src"], edge["dst"])] for edge in data["edges"]]
    return {"engine": "graphviz", "width": float(laid["bb"].split(",")[2]), "height": height,
            "nodes": nodes, "edges": edges}


def _read(name: str) -> str:
    with open(os.path.join(HERE, name), encoding="utf-8") as handle:
        return handle.read()


def _script_safe(text: str) -> str:
    """Text that can sit inside <script> ... </script> (no closing tag, no HTML comment opener)."""
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


def render_html(gm: fx.GraphModule, title: str = "", before: fx.GraphModule | None = None, fusions=()) -> str:
    """The page: both graphs side by side (``before`` on the left when given), the details panel,
    the fusion table, and the Python dumps; self-contained and offline."""
    title = title or "opfuse program"
    graphs = ([("Before fusion", before)] if before is not None else []) + [
        ("After fusion" if before is not None else "Graph", gm)]
    dot = find_dot()
    data = []
    for heading, module in graphs:
        entry = graph_data(module, heading)
        entry["layout"] = graphviz_layout(entry, dot) if dot else None
        data.append(entry)
    needs_dagre = any(entry["layout"] is None for entry in data)
    fusion_rows = "".join(
        f"<tr><td>{html.escape(f.fused_node)}</td><td>{html.escape(f.rule)}</td>"
        f"<td>{html.escape(', '.join(f.ops))}</td><td>{html.escape(str(f.impl))}</td>"
        f"<td>{html.escape(f.source)}</td></tr>" for f in fusions)
    panels = "".join(
        f'<section class="panel"><h2>{html.escape(heading)} <button type="button" class="fit" data-graph="{i}">fit'
        f'</button></h2><svg class="graph" id="graph-{i}" xmlns="http://www.w3.org/2000/svg" role="img" '
        f'aria-label="{html.escape(heading)}"></svg></section>' for i, (heading, _) in enumerate(graphs))
    dumps = "".join(f"<details><summary>{html.escape(heading)}: Python</summary><pre>"
                    f"{html.escape(render_python(module))}</pre></details>" for heading, module in graphs)
    engine = "Graphviz" if not needs_dagre else "dagre (in the page)"
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{_read('viewer.css')}</style>",
        "</head><body>",
        f"<header><h1>{html.escape(title)}</h1><p class=\"hint\">Hover or click a node for its details; its "
        f"producers and consumers light up. Drag to pan, wheel to zoom, double-click or <em>fit</em> to reset. "
        f"Layout: {engine}.</p></header>",
        f'<main class="{"two" if len(graphs) > 1 else "one"}">{panels}'
        '<aside id="details"><h2>Node</h2><p class="hint">Hover or click a node.</p></aside></main>',
        ("<h2>Fusions</h2><table class=\"fusions\"><tr><th>node</th><th>rule</th><th>ops</th><th>impl</th>"
         f"<th>defined at</th></tr>{fusion_rows}</table>" if fusions else ""),
        dumps,
        f'<script type="application/json" id="opfuse-data">{_script_safe(json.dumps(data))}</script>',
    ]
    if needs_dagre:
        parts.append(f"<script>{_script_safe(_read('vendor/dagre.min.js'))}</script>")
    parts.append(f"<script>{_script_safe(_read('viewer.js'))}</script>")
    parts.append("</body></html>\n")
    return "\n".join(parts)
