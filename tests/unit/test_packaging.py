"""pyproject.toml: metadata, dependencies (numpy declared, pybind11 only in the cuda extra), and
package data that matches the files the package needs at run time (CUDA sources, the viewer's
script and its vendored layout library, py.typed)."""

import glob
import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        return tomllib.load(handle)


def test_metadata_and_dependencies():
    meta = project()["project"]
    assert meta["license"] == "Apache-2.0" and os.path.isfile(os.path.join(ROOT, "LICENSE"))
    assert {"Homepage", "Source", "Issues"} <= set(meta["urls"]) and meta["classifiers"]
    names = [d.split(">")[0].split("=")[0] for d in meta["dependencies"]]
    assert "numpy" in names and "pybind11" not in names  # pybind11: only the extension build needs it
    assert any(d.startswith("pybind11") for d in meta["optional-dependencies"]["cuda"])
    assert any(d.startswith("matplotlib") for d in meta["optional-dependencies"]["plot"])


def test_package_data_covers_the_runtime_files():
    data = project()["tool"]["setuptools"]["package-data"]
    matched = set()
    for package, patterns in data.items():
        base = os.path.join(ROOT, *package.split("."))
        for pattern in patterns:
            found = glob.glob(os.path.join(base, pattern))
            assert found, f"{package}: {pattern!r} matches no file"
            matched.update(os.path.relpath(f, ROOT) for f in found)
    needed = {os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "opfuse", "**", "csrc", "*.*"),
                                                            recursive=True)}
    needed |= {"opfuse/py.typed", "opfuse/debug/viewer.js", "opfuse/debug/viewer.css",
               "opfuse/debug/vendor/dagre.min.js", "opfuse/debug/vendor/LICENSE.dagre",
               "opfuse/families/residual_norm/crossovers.json"}
    assert needed <= matched, sorted(needed - matched)
