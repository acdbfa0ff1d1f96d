#!/usr/bin/env python3
"""Report import cycles among the modules of a package (``make test`` runs it on ``opfuse``).

Every ``import`` statement counts, at module level and inside functions (an import deferred into
a function still makes the two modules depend on each other). An edge goes to the module an
import names: ``from pkg.mod import name`` is an edge to ``pkg.mod.name`` when that is a module of
the package (a file or a folder), else to ``pkg.mod``; ``import pkg.mod`` is an edge to
``pkg.mod``. A package's ``__init__`` is a node only where it is imported by name, not for every
import of one of its submodules. Cycles are the strongly connected components of more than one
module (or a module importing itself).

    python3 tools/import_cycles.py [--root opfuse] [--graph]

Exit status 1 when there is a cycle, with each cycle's modules and the lines that make it.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

import networkx as nx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules(package_dir: str, package: str) -> dict[str, str]:
    """``{module name: file path}`` of every module under ``package_dir``."""
    found = {}
    for folder, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        rel = os.path.relpath(folder, os.path.dirname(package_dir))
        prefix = rel.replace(os.sep, ".")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            module = prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"
            found[module] = os.path.join(folder, name)
    return found


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of a (possibly relative) import in ``module``."""
    if level == 0:
        return target or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_edges(modules: dict[str, str], package: str):
    """``(importer, imported, line)`` for every import of a package module."""
    for module, path in modules.items():
        is_package = path.endswith("__init__.py")
        with open(path) as handle:
            tree = ast.parse(handle.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == package and alias.name in modules:
                        yield module, alias.name, node.lineno
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(module, is_package, node.level, node.module)
                if source.split(".")[0] != package:
                    continue
                for alias in node.names:
                    child = f"{source}.{alias.name}"
                    if child in modules:
                        yield module, child, node.lineno
                    elif source in modules:
                        yield module, source, node.lineno


def find_cycles(package: str = "opfuse", root: str = ROOT):
    """``(graph, cycles)``: the import graph and its cycles (lists of modules)."""
    modules = _modules(os.path.join(root, package), package)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for src, dst, line in import_edges(modules, package):
        graph.add_edge(src, dst)
        graph[src][dst].setdefault("lines", []).append(line)
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    cycles += [[n] for n in graph.nodes if graph.has_edge(n, n)]
    return graph, sorted(cycles)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="opfuse", help="the package to check (a folder of the repository)")
    parser.add_argument("--graph", action="store_true", help="also print every edge")
    args = parser.parse_args(argv)
    graph, cycles = find_cycles(args.root)
    if args.graph:
        for src, dst, data in sorted(graph.edges(data=True)):
            print(f"{src} -> {dst}  (line {', '.join(map(str, data['lines']))})")
    for cycle in cycles:
        members = set(cycle)
        print(f"cycle: {' <-> '.join(cycle)}")
        for src in cycle:
            for dst in graph.successors(src):
                if dst in members:
                    lines = ", ".join(map(str, graph[src][dst]["lines"]))
                    print(f"  {src} imports {dst} (line {lines})")
    print(f"import_cycles: {graph.number_of_nodes()} modules, {graph.number_of_edges()} import edges, "
          f"{len(cycles)} cycle(s)")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
