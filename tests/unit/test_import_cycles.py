"""The import-cycle checker (tools/import_cycles.py): it finds cycles, deferred imports included,
and opfuse has none."""

from .tools_support import ROOT, load_tool, write_package

import_cycles = load_tool("import_cycles")


def _package(tmp_path, files):
    return write_package(tmp_path, "pkg", files)


def test_finds_a_cycle_held_together_by_an_import_inside_a_function(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from . import b\n",
        "b.py": "def f():\n    from .a import thing\n    return thing\n",
        "c.py": "from .sub import d\n",
        "sub/__init__.py": "",
        "sub/d.py": "import pkg.a\n",
    })
    graph, cycles = import_cycles.find_cycles("pkg", root)
    assert cycles == [["pkg.a", "pkg.b"]]
    assert graph.has_edge("pkg.c", "pkg.sub.d") and graph.has_edge("pkg.sub.d", "pkg.a")


def test_a_package_init_is_a_node_only_when_imported_by_name(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "from .a import x\n",
        "a.py": "from .sub import helper\nx = 1\n",
        "sub/__init__.py": "from ..a import x\n",
        "sub/helper.py": "",
    })
    _, cycles = import_cycles.find_cycles("pkg", root)
    assert cycles == []  # a imports the submodule pkg.sub.helper, not pkg.sub's __init__


def test_opfuse_has_no_import_cycles():
    graph, cycles = import_cycles.find_cycles("opfuse", ROOT)
    assert graph.number_of_nodes() > 50
    assert cycles == []
