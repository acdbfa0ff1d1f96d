"""Building and loading the CUDA extension ``_opfuse_cuda`` (sources in ``backend/csrc``).

The kernels are plain CUDA C++ with a small C++ API; pybind11 binds them (no torch headers, so
the build takes seconds, not minutes). On first use on a GPU host the module is compiled with
nvcc for sm_90a (plus compute_90 PTX for other archs) and cached under
``$OPFUSE_CACHE_DIR/ext/<hash>/``, the hash covering the sources, the flags and the Python ABI.
Ranks that start together build once: the others wait on a file lock. ``make build`` builds ahead;
``tools/check_cuda.py`` (``make check-cuda``) compiles everything without a GPU.

A host without CUDA or nvcc never needs the extension: :func:`load` raises
:class:`ExtensionUnavailable` with the reason, and the dispatch table falls back.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from .. import log
from ..config import config

__all__ = ["ExtensionUnavailable", "load", "status", "build", "sources", "find_nvcc"]

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
MODULE = "_opfuse_cuda"
NVCC_FLAGS = [
    "-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo", "-Xcompiler", "-fPIC",
    "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_90,code=compute_90",
]


class ExtensionUnavailable(RuntimeError):
    """The CUDA extension cannot be used here (no GPU, no nvcc, disabled, or the build failed)."""


_loaded = None
_failure: str | None = None


def sources() -> list[str]:
    return sorted(os.path.join(CSRC, f) for f in os.listdir(CSRC) if f.endswith((".cu", ".cpp")))


def _headers() -> list[str]:
    return sorted(os.path.join(CSRC, f) for f in os.listdir(CSRC) if f.endswith((".cuh", ".h")))


def find_nvcc() -> str | None:
    candidates = [os.environ.get("NVCC"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")]
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which("nvcc")


def _suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX") or ".so"


def _digest() -> str:
    h = hashlib.sha256()
    for path in sources() + _headers():
        h.update(os.path.basename(path).encode())
        with open(path, "rb") as handle:
            h.update(handle.read())
    h.update(" ".join(NVCC_FLAGS).encode())
    h.update(_suffix().encode())
    return h.hexdigest()[:16]


def _includes() -> list[str]:
    try:
        import pybind11
    except ImportError:
        raise ExtensionUnavailable("the CUDA extension build needs pybind11: pip install 'opfuse[cuda]' "
                                   "(or pip install pybind11)") from None

    return [f"-I{CSRC}", f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]


def _compile(nvcc: str, source: str, obj: str, extra: list[str]) -> None:
    cmd = [nvcc, *NVCC_FLAGS, *extra, *_includes(), "-c", source, "-o", obj]
    if source.endswith(".cpp"):
        cmd += ["-Xcompiler", "-fvisibility=hidden"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ExtensionUnavailable(f"nvcc failed on {os.path.basename(source)}:\n{' '.join(cmd)}\n{result.stderr}")
    if result.stderr.strip():
        sys.stderr.write(result.stderr)


def build(out_dir: str, nvcc: str | None = None, extra_flags: list[str] | None = None, jobs: int | None = None) -> str:
    """Compile and link the extension into ``out_dir``; returns the module path."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise ExtensionUnavailable("nvcc not found (set NVCC or CUDA_HOME)")
    os.makedirs(out_dir, exist_ok=True)
    extra = list(extra_flags or [])
    objects = []
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 2) as pool:
            futures = []
            for source in sources():
                obj = os.path.join(tmp, os.path.basename(source) + ".o")
                objects.append(obj)
                futures.append(pool.submit(_compile, nvcc, source, obj, extra))
            for future in futures:
                future.result()
        target = os.path.join(out_dir, MODULE + _suffix())
        partial = target + ".partial"
        cmd = [nvcc, "-shared", "-Xcompiler", "-fPIC", *objects, "-o", partial]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise ExtensionUnavailable(f"linking failed:\n{' '.join(cmd)}\n{result.stderr}")
        os.replace(partial, target)  # atomic: other processes never see a half-written module
    return target


def _cached_path() -> str:
    return os.path.join(config.cache_dir, "ext", _digest(), MODULE + _suffix())


def _import(path: str):
    loader = importlib.machinery.ExtensionFileLoader(MODULE, path)
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load():
    """The extension module, built on first use; raises :class:`ExtensionUnavailable`."""
    global _loaded, _failure
    if not config.cuda:
        raise ExtensionUnavailable("disabled by OPFUSE_CUDA=0")
    if _loaded is not None:
        return _loaded
    if _failure is not None:
        raise ExtensionUnavailable(_failure)
    import torch

    if not torch.cuda.is_available():
        raise ExtensionUnavailable("no CUDA device")
    path = _cached_path()
    try:
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(os.path.dirname(path) + ".lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one rank builds, the others wait and reuse
                if not os.path.exists(path):
                    log.extension_build(path, lambda: build(os.path.dirname(path)))
        else:
            log.extension_cached(path)
        _loaded = _import(path)
    except ExtensionUnavailable as error:
        _failure = str(error)
        raise
    except (OSError, ImportError) as error:
        _failure = f"cannot load {path}: {error}"
        raise ExtensionUnavailable(_failure) from error
    return _loaded


def status() -> str:
    """One line for ``python -m opfuse doctor``."""
    path = _cached_path()
    if _loaded is not None:
        return f"loaded from {path}"
    if _failure is not None:
        return f"unavailable: {_failure}"
    if os.path.exists(path):
        return f"built at {path}"
    return "not built yet (built on first use on a GPU host; `make build` builds ahead)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opfuse.backend.extension")
    parser.add_argument("--build", action="store_true", help="build into the cache (what first use would do)")
    parser.add_argument("--out", help="build into this directory instead of the cache")
    args = parser.parse_args(argv)
    if args.out:
        print(build(args.out))
        return 0
    if args.build:
        path = _cached_path()
        print(path if os.path.exists(path) else build(os.path.dirname(path)))
        return 0
    print(status())
    return 0


if __name__ == "__main__":
    sys.exit(main())
