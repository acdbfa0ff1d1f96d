#!/usr/bin/env python3
"""Fetch the FlashInfer headers that bench/allreduce_norm.py's FlashInfer column compiles against.

    python3 tools/fetch_flashinfer.py              # flashinfer-python 0.7.2 -> .thirdparty/flashinfer/

Downloads the ``flashinfer-python`` wheel (``pip download --no-deps``, for the GPU hosts' Python)
into ``.whl/`` unless it is already there, then extracts from it only what its TensorRT-LLM
all-reduce fusion kernel (``include/flashinfer/comm/trtllm_allreduce_fusion.cuh``) includes, found
by following ``#include`` lines through the wheel (FlashInfer's own headers plus the spdlog headers
its logging header pulls in), into ``.thirdparty/flashinfer/`` with a ``MANIFEST.json``. Both
folders are git-ignored; only ``.thirdparty/`` travels to the GPU host (the wheel is ~65 MB).
Last, unless ``--no-build``, the bench's binding (bench/flashinfer_ar/) is compiled and linked
with nvcc into ``.thirdparty/flashinfer/lib/``, so the GPU run only loads it (the bench rebuilds
it there when the sources changed).

opfuse itself never includes FlashInfer: these headers serve the side-by-side benchmark only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

DEFAULT_VERSION = "0.7.2"  # the version issue 21 measured
ENTRY = "flashinfer/comm/trtllm_allreduce_fusion.cuh"
# Include roots inside the wheel, tried in order for <...> includes and after the including
# file's own folder for "..." includes.
ROOTS = ("flashinfer/data/include", "flashinfer/data/spdlog/include")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)


def download(version: str, python: str, wheel_dir: str) -> str:
    """Path of the ``flashinfer-python==version`` wheel, downloaded into ``wheel_dir`` if absent."""
    os.makedirs(wheel_dir, exist_ok=True)
    stem = f"flashinfer_python-{version}-"
    for name in sorted(os.listdir(wheel_dir)):
        if name.startswith(stem) and name.endswith(".whl"):
            return os.path.join(wheel_dir, name)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
           "-d", wheel_dir, f"flashinfer-python=={version}"]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    for name in sorted(os.listdir(wheel_dir)):
        if name.startswith(stem) and name.endswith(".whl"):
            return os.path.join(wheel_dir, name)
    raise SystemExit(f"pip download did not leave a flashinfer_python-{version} wheel in {wheel_dir}")


def include_closure(names: set[str], read, entry: str) -> list[str]:
    """Wheel members reachable from ``entry`` (a path under the first include root) by ``#include``.

    ``names``: the wheel's member names; ``read(name) -> str``. Includes not found in the wheel
    (the CUDA toolkit's and the C++ library's) are left to the compiler. Conditional includes are
    all followed: a superset is harmless.
    """
    start = posixpath.join(ROOTS[0], entry)
    if start not in names:
        raise SystemExit(f"{start} is not in the wheel: this FlashInfer version lays out its sources differently")
    seen, todo = {start}, [start]
    while todo:
        member = todo.pop()
        for kind, target in INCLUDE.findall(read(member)):
            candidates = [posixpath.normpath(posixpath.join(posixpath.dirname(member), target))] if kind == '"' else []
            candidates += [posixpath.join(root, target) for root in ROOTS]
            found = next((c for c in candidates if c in names), None)
            if found and found not in seen:
                seen.add(found)
                todo.append(found)
    return sorted(seen)


def extract(wheel: str, dest: str, version: str) -> dict:
    """Extract the include closure of the fusion kernel into ``dest``; returns the manifest."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        members = include_closure(names, lambda n: archive.read(n).decode("utf-8", "replace"), ENTRY)
        if os.path.isdir(dest):
            shutil.rmtree(dest)
        for member in members:
            root = next(r for r in ROOTS if member.startswith(r + "/"))
            folder = "include" if root == ROOTS[0] else "spdlog/include"
            target = os.path.join(dest, folder, member[len(root) + 1:])
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as handle:
                handle.write(archive.read(member))
    with open(wheel, "rb") as handle:
        digest = hashlib.sha256(handle.read()).hexdigest()
    manifest = {"package": "flashinfer-python", "version": version, "wheel": os.path.basename(wheel),
                "wheel_sha256": digest, "entry": ENTRY, "files": len(members),
                "include_dirs": ["include", "spdlog/include"]}
    with open(os.path.join(dest, "MANIFEST.json"), "w") as handle:
        json.dump(manifest, handle, indent=1)
    return manifest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", default=DEFAULT_VERSION, help="flashinfer-python version (default %(default)s)")
    parser.add_argument("--python", default="3.12", help="Python version of the GPU hosts (default %(default)s)")
    parser.add_argument("--wheel-dir", default=os.path.join(ROOT, ".whl"))
    parser.add_argument("--dest", default=os.path.join(ROOT, ".thirdparty", "flashinfer"))
    parser.add_argument("--no-build", action="store_true", help="only extract; do not prebuild the bench binding")
    args = parser.parse_args()
    wheel = download(args.version, args.python, args.wheel_dir)
    manifest = extract(wheel, args.dest, args.version)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.dest) for f in fs)
    print(f"extracted {manifest['files']} headers of {manifest['wheel']} into {args.dest} ({size / 2**20:.1f} MiB)")
    if args.no_build:
        return 0
    from flashinfer_ar import build  # bench/flashinfer_ar/build.py

    try:
        path = build.prebuild(args.dest)
    except build.FlashInferUnavailable as error:
        print(f"binding not prebuilt: {error}")
        return 1
    print(f"binding prebuilt: {path} ({os.path.getsize(path) / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
