"""Building and loading the FlashInfer binding (``fiar.cu``) of the benchmarks.

The headers are those ``tools/fetch_flashinfer.py`` extracted from the flashinfer-python wheel
into ``.thirdparty/flashinfer/`` (``$OPFUSE_FLASHINFER_DIR`` overrides the folder). The shared
library is named after a hash of ``fiar.cu``, the headers' manifest and the nvcc flags; it is
looked up first in ``<headers>/lib/`` (prebuilt by the fetch tool where the headers were
extracted), then in ``$OPFUSE_CACHE_DIR/flashinfer_ar/``, and built there with nvcc when absent.
cudart is linked statically, so the library needs only the driver.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time

__all__ = ["FlashInferUnavailable", "headers_dir", "library_name", "prebuild", "load"]

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SOURCE = os.path.join(HERE, "fiar.cu")
ABI = 1  # opfuse_fiar_abi() in fiar.cu
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC", "-shared",
              "-gencode=arch=compute_90a,code=sm_90a", "-cudart", "static", "-DNDEBUG"]


class FlashInferUnavailable(RuntimeError):
    """The FlashInfer column cannot run here (no headers, no nvcc, build or load failed)."""


def headers_dir() -> str:
    return os.environ.get("OPFUSE_FLASHINFER_DIR") or os.path.join(REPO, ".thirdparty", "flashinfer")


def _manifest(folder: str) -> dict:
    path = os.path.join(folder, "MANIFEST.json")
    if not os.path.isfile(path):
        raise FlashInferUnavailable(f"no FlashInfer headers at {folder} (run tools/fetch_flashinfer.py and carry "
                                    f".thirdparty/ to this host, or set OPFUSE_FLASHINFER_DIR)")
    with open(path) as handle:
        return json.load(handle)


def library_name(folder: str | None = None) -> str:
    folder = folder or headers_dir()
    digest = hashlib.sha256()
    with open(SOURCE, "rb") as handle:
        digest.update(handle.read())
    digest.update(json.dumps(_manifest(folder), sort_keys=True).encode())
    digest.update(" ".join(NVCC_FLAGS).encode())
    return f"libopfuse_fiar-{digest.hexdigest()[:16]}.so"


def _nvcc() -> str:
    for path in (os.environ.get("NVCC"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
                 shutil.which("nvcc")):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FlashInferUnavailable("nvcc not found (set NVCC or CUDA_HOME)")


def _build(folder: str, target: str) -> str:
    manifest = _manifest(folder)
    includes = [f"-I{os.path.join(folder, d)}" for d in manifest.get("include_dirs", ["include"])]
    os.makedirs(os.path.dirname(target), exist_ok=True)
    partial = f"{target}.{os.getpid()}.partial"
    cmd = [_nvcc(), *NVCC_FLAGS, *includes, SOURCE, "-o", partial]
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-15:])
        raise FlashInferUnavailable(f"nvcc failed building the binding ({' '.join(cmd)}):\n{tail}")
    os.replace(partial, target)  # atomic: a concurrent loader never sees half a library
    print(f"flashinfer binding: built {target} in {time.perf_counter() - start:.0f} s", flush=True)
    return target


def prebuild(folder: str | None = None) -> str:
    """Build the library into ``<headers>/lib/`` (where the GPU run looks first)."""
    folder = folder or headers_dir()
    return _build(folder, os.path.join(folder, "lib", library_name(folder)))


def _cache_dir() -> str:
    base = os.environ.get("OPFUSE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "opfuse")
    return os.path.join(base, "flashinfer_ar")


def load() -> ctypes.CDLL:
    """The binding, built on first use when no prebuilt library matches the sources."""
    folder = headers_dir()
    name = library_name(folder)
    path = os.path.join(folder, "lib", name)
    if not os.path.isfile(path):
        path = os.path.join(_cache_dir(), name)
        if not os.path.isfile(path):
            os.makedirs(_cache_dir(), exist_ok=True)
            failed = path + ".failed"
            with open(path + ".lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # ranks start together: one builds, the others wait
                if os.path.isfile(failed):  # a rank before us failed: do not spend another build on it
                    with open(failed) as handle:
                        raise FlashInferUnavailable(f"{handle.read()} (remove {failed} to retry)")
                if not os.path.isfile(path):
                    try:
                        _build(folder, path)
                    except FlashInferUnavailable as error:
                        with open(failed, "w") as handle:
                            handle.write(str(error))
                        raise
    try:
        lib = ctypes.CDLL(path)
    except OSError as error:
        raise FlashInferUnavailable(f"cannot load {path}: {error}") from error
    lib.opfuse_fiar_abi.restype = ctypes.c_int
    if lib.opfuse_fiar_abi() != ABI:
        raise FlashInferUnavailable(f"{path}: ABI {lib.opfuse_fiar_abi()}, expected {ABI}")
    fn = lib.opfuse_fiar_residual_rmsnorm
    fn.restype = ctypes.c_char_p
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int,              # dtype, world, rank
                   ctypes.c_int64, ctypes.c_int64,                        # tokens, hidden
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,     # workspace, x, residual_in
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,     # residual_out, norm_out, gamma
                   ctypes.c_float,                                        # eps
                   ctypes.c_int, ctypes.c_int, ctypes.c_int,              # oneshot, pdl, trigger at end
                   ctypes.c_void_p]                                       # stream
    return lib


def main() -> int:
    """``python3 bench/flashinfer_ar/build.py``: build (or find) the library and say where, or why not.
    Exit status 0 either way: the bench skips the FlashInfer column when it is unavailable."""
    try:
        lib = load()
    except FlashInferUnavailable as error:
        print(f"flashinfer binding unavailable: {error}")
        return 0
    print(f"flashinfer binding: {lib._name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
