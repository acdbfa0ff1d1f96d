"""The HTML graph viewer's page (``Program.dump("html")``): one offline document whose data
holds every node's details and every edge, the output node's real outputs, and a layout
(Graphviz when installed, else the vendored dagre script). The drawing itself is checked in a
browser by test_viewer_browser.py."""

import json
import re

import pytest
import torch

import opfuse
from opfuse.cli.demo import build_block
from opfuse.debug import html as viewer


@pytest.fixture
def program(world1, rng):
    block = build_block(16, 32)
    x, r = torch.randn(4, 16, generator=rng), torch.randn(4, 16, generator=rng)
    return opfuse.compile(block, x, r)


def page_data(page: str) -> list:
    found = re.search(r'<script type="application/json" id="opfuse-data">(.*?)</script>', page, re.S)
    return json.loads(found.group(1).replace("<\\/", "</"))


def test_page_is_one_offline_document(program, monkeypatch):
    monkeypatch.setenv("OPFUSE_DOT", "none")
    page = program.dump("html", graph="both")
    assert page.startswith("<!doctype html>") and page.endswith("</html>\n")
    assert page.count("<html") == 1 and page.count("</html>") == 1
    # Self-contained: no external script, style, image or link.
    assert not re.search(r"<(script|img|link)[^>]*\b(src|href)=", page)
    assert "var dagre=" in page and "window.opfuseViewer" in page  # the layout script is inlined
    assert page.count('<svg class="graph"') == 2


def test_page_data_describes_nodes_edges_and_outputs(program, monkeypatch):
    monkeypatch.setenv("OPFUSE_DOT", "none")
    before, after = page_data(program.dump("html", graph="both"))
    assert (before["title"], after["title"]) == ("Before fusion", "After fusion")
    gm = program.graph_module
    nodes = {n["id"]: n for n in after["nodes"]}
    assert list(nodes) == [n.name for n in gm.graph.nodes]
    # Every producer -> consumer pair is an edge, with the consumer's argument order as port.
    want = {(src.name, n.name, port) for n in gm.graph.nodes
            for port, src in enumerate(dict.fromkeys(n.all_input_nodes))}
    assert {(e["src"], e["dst"], e["port"]) for e in after["edges"]} == want
    fused = nodes["fused_allreduce_add_rmsnorm"]
    assert fused["cls"] == "fused" and fused["ports"] == 2
    assert re.fullmatch(r"allreduce_add_rmsnorm at .*residual_norm/rules\.py:\d+", fused["info"]["rule"])
    assert fused["info"]["implementation"] == "reference" and "AllReduce (AllReduce)" not in fused["info"]["covers"]
    assert fused["info"]["python"].startswith("fused_allreduce_add_rmsnorm = self.fused_allreduce_add_rmsnorm(")
    assert fused["info"]["sharding"] == "replicated"
    # The output node shows what it returns (it used to read "output ?").
    output = nodes["output"]
    assert "?" not in output["lines"][2]
    assert output["lines"][2] == "(float32[4, 16]@cpu, float32[4, 16]@cpu)"
    assert all(n["info"]["python"] for n in before["nodes"] + after["nodes"])


def test_graphviz_layout_when_dot_is_installed(program):
    if viewer.find_dot() is None:
        pytest.skip("Graphviz (dot) is not installed: the page uses dagre (tested above)")
    page = program.dump("html", graph="both")
    assert "var dagre=" not in page  # laid out already: no layout script
    for graph in page_data(page):
        layout = graph["layout"]
        assert layout["engine"] == "graphviz" and len(layout["edges"]) == len(graph["edges"])
        boxes = [layout["nodes"][n["id"]] for n in graph["nodes"]]
        for i, a in enumerate(boxes):  # no two boxes overlap
            for b in boxes[i + 1:]:
                assert abs(a["x"] - b["x"]) >= (a["w"] + b["w"]) / 2 or abs(a["y"] - b["y"]) >= (a["h"] + b["h"]) / 2
        # Each edge starts at its source box and its tip touches its target box.
        for edge, route in zip(graph["edges"], layout["edges"]):
            for end, name in ((route["bezier"][0], edge["src"]), (route["tip"], edge["dst"])):
                box = layout["nodes"][name]
                dx, dy = abs(end[0] - box["x"]) - box["w"] / 2, abs(end[1] - box["y"]) - box["h"] / 2
                assert max(dx, dy) <= 2.0 and max(dx, dy) >= -2.0, (edge, end, box)
