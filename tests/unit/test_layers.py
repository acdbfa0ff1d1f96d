"""The import direction of opfuse's layers (tools/layers.py): front ends -> core -> families ->
machinery -> ops -> runtime -> foundation, sibling front ends, declared family uses, families
reached through their one list; deferred imports count. docs/ARCHITECTURE.md's diagram is the one
the import graph gives."""

from .tools_support import ROOT, load_tool, write_package

layers = load_tool("layers")


def _package(tmp_path, files):
    return write_package(tmp_path, "opfuse", files)


def test_opfuse_imports_follow_the_layers():
    assert layers.check() == []


def test_every_module_has_a_layer():
    graph, _ = layers.import_cycles.find_cycles("opfuse", ROOT)
    assert graph.number_of_nodes() > 100
    assert {layers.layer_of(m)[0] for m in graph.nodes} == {name for name, _, _ in layers.LAYERS}


def test_the_checker_finds_each_kind_of_violation(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "config.py": "",
        "sequential/__init__.py": "",
        "sequential/block.py": "def f():\n    from ..torch_compile import backend\n",   # deferred, sibling
        "torch_compile/__init__.py": "",
        "torch_compile/backend.py": "from ..core import pipeline\nfrom ..families import FAMILIES\n",  # fine
        "core/__init__.py": "",
        "core/pipeline.py": "from ..families.norms import op\nfrom .. import config\n",       # past the list
        "ops/__init__.py": "",
        "ops/linear.py": "from ..core import pipeline\n",                                       # upward
        "families/__init__.py": "from .norms import op\nFAMILIES = ()\n",
        "families/norms/__init__.py": "",
        "families/norms/op.py": "from ..gemms import kernels\nfrom ...ops import linear\n",    # undeclared use
        "families/gemms/__init__.py": "",
        "families/gemms/kernels.py": "",
    })
    problems = layers.check("opfuse", root)
    assert any(p.startswith("opfuse.sequential.block -> opfuse.torch_compile.backend") and "sibling" in p
               for p in problems), problems
    assert any(p.startswith("opfuse.core.pipeline -> opfuse.families.norms.op") and "through opfuse.families" in p
               for p in problems), problems
    assert any(p.startswith("opfuse.ops.linear -> opfuse.core.pipeline") and "ops imports core" in p
               for p in problems), problems
    assert any(p.startswith("opfuse.families.norms.op -> opfuse.families.gemms.kernels") and "FAMILY_USES" in p
               for p in problems), problems
    assert len(problems) == 4, problems


def test_every_exception_and_family_use_is_still_needed():
    graph, _ = layers.import_cycles.find_cycles("opfuse", ROOT)
    for src, dst in layers.EXCEPTIONS:
        assert graph.has_edge(src, dst), f"{src} -> {dst} no longer imported: drop it from EXCEPTIONS"
    used = {(layers._family(s), layers._family(d)) for s, d in graph.edges
            if layers._family(s) and layers._family(d) and layers._family(s) != layers._family(d)}
    declared = {(a, b) for a, bs in layers.FAMILY_USES.items() for b in bs}
    assert used == declared


def test_architecture_diagram_is_current():
    with open(layers.DOC) as handle:
        text = handle.read()
    assert layers.doc_block() in text, "docs/ARCHITECTURE.md: run python3 tools/layers.py --write-doc"
