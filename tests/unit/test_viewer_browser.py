"""The graph viewer in a real headless Chromium (tools/browser): for the demo block's page
(``python -m opfuse dump --format html -o FILE``), every edge's two ends touch the boxes of its
source and target (at the port numbered with its argument where the target has several inputs),
no edge passes through a box, no text overflows its box, the page logs no
console error and fetches nothing, and clicking a node shows its details and highlights its
producers and consumers. Checked with the dagre layout (always) and with Graphviz (when
installed). Saves a screenshot (``OPFUSE_SCREENSHOT_DIR=docs/img`` writes the ones docs/guide.md shows).

Chromium comes from tools/browser/install.sh (npm: puppeteer-core + @sparticuz/chromium); the
test skips, saying why, where node/npm or the registry are missing."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from opfuse.debug.html import find_dot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools", "browser")

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser_ready():
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node/npm not installed: no headless Chromium for the viewer test")
    try:
        subprocess.run(["bash", os.path.join(TOOLS, "install.sh")], check=True, capture_output=True, text=True,
                       timeout=600)
    except subprocess.CalledProcessError as error:
        pytest.skip(f"cannot install headless Chromium (tools/browser/install.sh): {error.stderr.strip()[-300:]}")
    except subprocess.TimeoutExpired:
        pytest.skip("tools/browser/install.sh took over 10 minutes (no registry?)")


def dump_page(path, dot: str | None) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", OPFUSE_DOT=dot or "none")
    result = subprocess.run([sys.executable, "-m", "opfuse", "dump", "--format", "html", "-o", str(path)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def check(page, shot, click="fused_allreduce_add_rmsnorm") -> dict:
    result = subprocess.run(["node", os.path.join(TOOLS, "check_viewer.js"), str(page), str(shot), "--click", click],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0 and "executable" in result.stderr.lower():
        pytest.skip(f"headless Chromium does not start here: {result.stderr.strip()[-300:]}")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


LAYOUTS = ["dagre", "graphviz"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_viewer_draws_the_graph_right(browser_ready, layout, tmp_path):
    dot = None
    if layout == "graphviz":
        dot = find_dot()
        if dot is None:
            pytest.skip("Graphviz (dot) is not installed")
    page = tmp_path / "demo.html"
    dump_page(page, dot)
    shots = os.environ.get("OPFUSE_SCREENSHOT_DIR")
    shot = os.path.join(shots, f"viewer_{layout}.png") if shots else tmp_path / "viewer.png"
    got = check(page, shot)
    assert got["errors"] == [] and got["external_requests"] == []
    assert got["engines"] == [layout, layout] and got["graphs"] == 2
    assert got["nodes"] >= 20 and len(got["edges"]) >= 20
    for edge in got["edges"]:
        where = f"{edge['graph']}: {edge['src']} -> {edge['dst']}"
        assert edge["start"] <= 2.0, f"{where} starts {edge['start']:.1f} px from its source box"
        assert edge["end"] <= 2.0, f"{where} ends {edge['end']:.1f} px from its target box"
        assert edge["through"] == [], f"{where} passes through {edge['through']}"
        if edge["port_dx"] is not None:  # into a node with several inputs: the port of its argument
            assert edge["port_dx"] <= 2.0, f"{where} ends {edge['port_dx']:.1f} px beside its port"
    assert sum(edge["port_dx"] is not None for edge in got["edges"]) >= 8  # 2 ports x 2 nodes x 2 graphs
    assert got["overflow"] == [], got["overflow"][:3]
    # Clicking the fused node: its details, and its 2 producers and 2 consumers highlighted.
    details = got["details"]
    assert "fused_allreduce_add_rmsnorm = self.fused_allreduce_add_rmsnorm(" in details
    assert "allreduce_add_rmsnorm at" in details and "rules.py:" in details
    assert "reference" in details and "replicated" in details and "(float32[8, 64]@cpu" in details
    assert got["highlight"] == {"producers": 2, "consumers": 2}
    assert os.path.getsize(shot) > 10_000
