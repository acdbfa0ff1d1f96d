"""Loading the repository's tools/ scripts in tests, and writing small packages for them to check."""

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_tool(name: str):
    """The module ``tools/<name>.py`` (registered in ``sys.modules``: dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def write_package(tmp_path, package: str, files: dict) -> str:
    """``files`` (``{path in the package: source}``) under ``tmp_path/package``; returns the root."""
    for name, text in files.items():
        path = tmp_path / package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)
