"""Building and loading the CUDA extension modules, one per fused-op family.

A family keeps its kernels in ``families/<family>/csrc/`` (plain CUDA C++ with a small C++ API and
a pybind11 ``bindings.cpp`` defining module ``_opfuse_<family>``); shared device helpers live in
``runtime/csrc/``. No torch headers are involved, so a build takes seconds. On first use
on a GPU host a family's module is compiled with nvcc for sm_90a (plus compute_90 PTX for other
archs) and cached under ``$OPFUSE_CACHE_DIR/ext/<family>-<hash>/``, the hash covering the
family's sources, the shared headers, the flags and the Python ABI. Ranks that start together
build once: the others wait on a file lock. ``make build`` builds every family ahead;
``tools/check_cuda.py`` (``make check-cuda``) compiles everything without a GPU.

A host without CUDA or nvcc never needs the extensions: :func:`load` raises
:class:`ExtensionUnavailable` with the reason, and capability checks report it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from typing import NamedTuple

from .. import log
from ..config import config

__all__ = ["ExtensionUnavailable", "load", "status", "build", "families", "sources", "find_nvcc", "FAMILIES_DIR",
           "SHARED_CSRC"]

FAMILIES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "families")
SHARED_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
NVCC_FLAGS = [
    "-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo", "-Xcompiler", "-fPIC",
    "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_90,code=compute_90",
]


class ExtensionUnavailable(RuntimeError):
    """A CUDA extension cannot be used here (no GPU, no nvcc, disabled, or the build failed)."""


_loaded: dict[str, object] = {}
_failures: dict[str, str] = {}


def families() -> list[str]:
    """Families with CUDA sources (``families/<family>/csrc/``), sorted."""
    return sorted(name for name in os.listdir(FAMILIES_DIR) if os.path.isdir(os.path.join(FAMILIES_DIR, name, "csrc")))


def _csrc(family: str) -> str:
    path = os.path.join(FAMILIES_DIR, family, "csrc")
    if not os.path.isdir(path):
        raise ExtensionUnavailable(f"no CUDA sources for family {family!r}; families with kernels: {families()}")
    return path


def module_name(family: str) -> str:
    return f"_opfuse_{family}"


def sources(family: str) -> list[str]:
    folder = _csrc(family)
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith((".cu", ".cpp")))


def _headers(family: str) -> list[str]:
    return sorted(os.path.join(folder, f) for folder in (_csrc(family), SHARED_CSRC)
                  for f in os.listdir(folder) if f.endswith((".cuh", ".h")))


def find_nvcc() -> str | None:
    """nvcc from ``$NVCC``, ``$CUDA_HOME/bin`` (default /usr/local/cuda) or ``PATH``."""
    candidates = [os.environ.get("NVCC"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which("nvcc")


class PythonABI(NamedTuple):
    """What a module is built for: the interpreter's extension suffix and the include folders of
    its headers and of pybind11's."""

    suffix: str
    includes: tuple[str, ...]

    @classmethod
    def of(cls, python: str | None = None) -> "PythonABI":
        """This interpreter's ABI, or that of the interpreter at path ``python`` (which must have
        pybind11): lets a host without a GPU build the modules a GPU host's Python loads."""
        if python is None:
            try:
                import pybind11
            except ImportError:
                raise ExtensionUnavailable("the CUDA extension build needs pybind11: pip install 'opfuse[cuda]' "
                                           "(or pip install pybind11)") from None
            return cls(sysconfig.get_config_var("EXT_SUFFIX") or ".so",
                       (pybind11.get_include(), sysconfig.get_paths()["include"]))
        probe = ("import json, sysconfig, pybind11; print(json.dumps([sysconfig.get_config_var('EXT_SUFFIX'), "
                 "pybind11.get_include(), sysconfig.get_paths()['include']]))")
        try:
            result = subprocess.run([python, "-c", probe], capture_output=True, text=True)
        except OSError as error:
            raise ExtensionUnavailable(f"--python {python}: cannot run it ({error.strerror or error})") from None
        if result.returncode != 0:
            raise ExtensionUnavailable(f"--python {python}: cannot read its ABI (it needs pybind11): "
                                       f"{result.stderr.strip().splitlines()[-1:] or result.returncode}")
        suffix, *includes = json.loads(result.stdout)
        return cls(suffix or ".so", tuple(includes))


def _suffix(abi: PythonABI | None) -> str:
    return abi.suffix if abi else (sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def _digest(family: str, abi: PythonABI | None = None) -> str:
    h = hashlib.sha256()
    for path in sources(family) + _headers(family):
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as handle:
            h.update(handle.read())
    h.update(" ".join(NVCC_FLAGS).encode())
    h.update(_suffix(abi).encode())
    return h.hexdigest()[:16]


def _includes(family: str, abi: PythonABI) -> list[str]:
    return [f"-I{_csrc(family)}", f"-I{SHARED_CSRC}", *(f"-I{folder}" for folder in abi.includes)]


def _compile(nvcc: str, family: str, source: str, obj: str, extra: list[str], abi: PythonABI) -> None:
    cmd = [nvcc, *NVCC_FLAGS, *extra, *_includes(family, abi), "-c", source, "-o", obj]
    if source.endswith(".cpp"):
        cmd += ["-Xcompiler", "-fvisibility=hidden"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ExtensionUnavailable(f"nvcc failed on {os.path.basename(source)}:\n{' '.join(cmd)}\n{result.stderr}")
    if result.stderr.strip():
        sys.stderr.write(result.stderr)


def build(family: str, out_dir: str, nvcc: str | None = None, extra_flags: list[str] | None = None,
          jobs: int | None = None, abi: PythonABI | None = None) -> str:
    """Compile and link ``family``'s module into ``out_dir`` for ``abi`` (default: this
    interpreter); returns the module path."""
    abi = abi or PythonABI.of()
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise ExtensionUnavailable("nvcc not found (set NVCC or CUDA_HOME)")
    os.makedirs(out_dir, exist_ok=True)
    extra = list(extra_flags or [])
    objects = []
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as pool:
            futures = []
            for source in sources(family):
                obj = os.path.join(tmp, os.path.basename(source) + ".o")
                objects.append(obj)
                futures.append(pool.submit(_compile, nvcc, family, source, obj, extra, abi))
            for future in futures:
                future.result()
        target = os.path.join(out_dir, module_name(family) + abi.suffix)
        partial = target + ".partial"
        cmd = [nvcc, "-shared", "-Xcompiler", "-fPIC", *objects, "-o", partial]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise ExtensionUnavailable(f"linking failed:\n{' '.join(cmd)}\n{result.stderr}")
        os.replace(partial, target)  # atomic: other processes never see a half-written module
    return target


def _cached_path(family: str, abi: PythonABI | None = None) -> str:
    return os.path.join(config.cache_dir, "ext", f"{family}-{_digest(family, abi)}", module_name(family) + _suffix(abi))


def _import(family: str, path: str):
    name = module_name(family)
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load(family: str):
    """``family``'s extension module, built on first use; raises :class:`ExtensionUnavailable`."""
    if not config.cuda:
        raise ExtensionUnavailable("disabled by OPFUSE_CUDA=0")
    module = _loaded.get(family)
    if module is not None:
        return module
    if family in _failures:
        raise ExtensionUnavailable(_failures[family])
    import torch

    if not torch.cuda.is_available():
        raise ExtensionUnavailable("no CUDA device")
    path = _cached_path(family)
    try:
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(os.path.dirname(path) + ".lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one rank builds, the others wait and reuse
                if not os.path.exists(path):
                    log.extension_build(path, lambda: build(family, os.path.dirname(path)))
        else:
            log.extension_cached(path)
        module = _import(family, path)
    except ExtensionUnavailable as error:
        _failures[family] = str(error)
        raise
    except (OSError, ImportError) as error:
        _failures[family] = f"cannot load {path}: {error}"
        raise ExtensionUnavailable(_failures[family]) from error
    _loaded[family] = module
    return module


def status(family: str) -> str:
    """One line for ``python -m opfuse doctor``."""
    path = _cached_path(family)
    if family in _loaded:
        return f"loaded from {path}"
    if family in _failures:
        return f"unavailable: {_failures[family]}"
    if os.path.exists(path):
        return f"built at {path}"
    return "not built yet (built on first use on a GPU host; `make build` builds ahead)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opfuse.runtime.extension")
    parser.add_argument("--build", action="store_true", help="build every family into the cache (what first use does)")
    parser.add_argument("--out", help="build into this directory instead of the cache")
    parser.add_argument("--python", help="build for the interpreter at this path (it needs pybind11), e.g. a GPU "
                                         "host's Python version, into the cache that host will read")
    args = parser.parse_args(argv)
    abi = PythonABI.of(args.python) if args.python else None
    for family in families():
        if args.out:
            print(build(family, args.out, abi=abi))
        elif args.build or args.python:
            path = _cached_path(family, abi)
            print(path if os.path.exists(path) else build(family, os.path.dirname(path), abi=abi))
        else:
            print(f"{family}: {status(family)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
