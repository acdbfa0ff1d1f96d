"""cuBLASMp 0.7 (``pip install opfuse[cublasmp]``, package ``nvidia-cublasmp-cu13``) through ctypes,
with the few NCCL and NVSHMEM entry points it needs: nothing is compiled, nothing is needed to
install opfuse, and a missing or unloadable library is a reason string, never an import error.

cuBLASMp 0.7 takes an ``ncclComm_t`` per process grid (``cublasMpGridCreate``) and initialises
NVSHMEM inside the first grid it creates; its tensor-parallel matmuls want their device workspace
in NVSHMEM's symmetric heap (``nvshmem_malloc``, collective). Its shared-library dependencies
(``libnccl.so.2``, ``libnvshmem_host.so.3``, ``libcublas(Lt).so.13``) are the ones torch's wheels
already load; where one is not loaded yet it is loaded from the ``nvidia-*`` wheel that holds it,
never a second copy of one already in the process. Newer cuBLASMp wheels (0.8+) need NCCL >= 2.29
(``ncclCommQueryProperties``), which torch 2.11's NCCL 2.28 lacks: they fail to load, and the
reason says so.

The signatures below are cuBLASMp 0.7's ``cublasmp.h``; tests/unit/test_nvidia_libs.py compares
them with the header when the wheel is installed.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
import threading

__all__ = ["PACKAGE", "SIGNATURES", "status", "describe", "lib", "nccl", "nvshmem", "check", "check_nccl", "version",
           "NcclUniqueId", "CUDA_R_16F", "CUDA_R_16BF", "CUBLAS_COMPUTE_32F", "CUBLAS_OP_N", "CUBLAS_OP_T",
           "GRID_COL_MAJOR", "GRID_ROW_MAJOR", "ATTR_TRANSA", "ATTR_TRANSB", "ATTR_ALGO_TYPE", "ALGO_SPLIT_P2P"]

PACKAGE = "nvidia-cublasmp-cu13"
_INSTALL_HINT = "pip install opfuse[cublasmp]"
_SONAME = "libcublasmp.so.0"

# Constants of cublasmp.h / library_types.h / cublas_api.h.
CUDA_R_16F, CUDA_R_16BF = 2, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
GRID_COL_MAJOR, GRID_ROW_MAJOR = 0, 1
ATTR_TRANSA, ATTR_TRANSB, ATTR_ALGO_TYPE = 0, 1, 3
# Peer-to-peer split pipelines (never the multicast algorithms: NVLink multicast stays off).
ALGO_SPLIT_P2P = 1
_STATUS = {0: "SUCCESS", 1: "NOT_INITIALIZED", 2: "ALLOCATION_FAILED", 3: "INVALID_VALUE",
           4: "ARCHITECTURE_MISMATCH", 5: "EXECUTION_FAILED", 6: "INTERNAL_ERROR", 7: "NOT_SUPPORTED"}

_p, _i64, _i32, _sz, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_size_t, ctypes.c_int
_pp, _psz, _pint = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_int)

#: ``{function: (restype, [argtypes])}`` of the cuBLASMp functions opfuse calls.
SIGNATURES = {
    "cublasMpGetVersion": (_int, [_pint]),
    "cublasMpCreate": (_int, [_pp, _p]),
    "cublasMpDestroy": (_int, [_p]),
    "cublasMpStreamSet": (_int, [_p, _p]),
    "cublasMpGridCreate": (_int, [_i64, _i64, _int, _p, _pp]),
    "cublasMpGridDestroy": (_int, [_p]),
    "cublasMpMatrixDescriptorCreate": (_int, [_i64, _i64, _i64, _i64, _i64, _i64, _i64, _int, _p, _pp]),
    "cublasMpMatrixDescriptorDestroy": (_int, [_p]),
    "cublasMpMatmulDescriptorCreate": (_int, [_pp, _int]),
    "cublasMpMatmulDescriptorDestroy": (_int, [_p]),
    "cublasMpMatmulDescriptorAttributeSet": (_int, [_p, _int, _p, _sz]),
    "cublasMpMatmul_bufferSize": (_int, [_p, _p, _i64, _i64, _i64, _p, _p, _i64, _i64, _p, _p, _i64, _i64, _p, _p,
                                         _p, _i64, _i64, _p, _p, _i64, _i64, _p, _psz, _psz]),
    "cublasMpMatmul": (_int, [_p, _p, _i64, _i64, _i64, _p, _p, _i64, _i64, _p, _p, _i64, _i64, _p, _p,
                              _p, _i64, _i64, _p, _p, _i64, _i64, _p, _p, _sz, _p, _sz]),
    "cublasMpNumroc": (_i64, [_i64, _i64, _i32, _i32, _i32]),
}


class NcclUniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes (``NCCL_UNIQUE_ID_BYTES``), passed by value."""

    _fields_ = [("internal", ctypes.c_char * 128)]


_NCCL_SIGNATURES = {
    "ncclGetUniqueId": (_int, [ctypes.POINTER(NcclUniqueId)]),
    "ncclCommInitRank": (_int, [_pp, _int, NcclUniqueId, _int]),
    "ncclGetErrorString": (ctypes.c_char_p, [_int]),
}
_NVSHMEM_SIGNATURES = {"nvshmem_malloc": (_p, [_sz]), "nvshmem_free": (None, [_p])}

# SONAME -> where its nvidia-* wheel puts it (relative to a site-packages directory).
_DEPENDENCIES = {
    "libnccl.so.2": ("nvidia/nccl/lib",),
    "libnvshmem_host.so.3": ("nvidia/nvshmem/lib",),
    "libcublasLt.so.13": ("nvidia/cu13/lib", "nvidia/cublas/lib"),
    "libcublas.so.13": ("nvidia/cu13/lib", "nvidia/cublas/lib"),
}

_lock = threading.Lock()
_state: dict = {}


def _search(relative_dirs, name) -> str | None:
    for base in sys.path:
        for rel in relative_dirs:
            path = os.path.join(base or ".", rel, name)
            if os.path.exists(path):
                return path
    return None


def _load_once(soname: str, relative_dirs) -> ctypes.CDLL:
    """``soname`` as already loaded in this process, else from its wheel, else by the linker's
    search; global symbols (cuBLASMp resolves against them)."""
    mode = ctypes.RTLD_GLOBAL
    try:
        return ctypes.CDLL(soname, mode=mode | os.RTLD_NOLOAD)
    except OSError:
        pass
    path = _search(relative_dirs, soname)
    return ctypes.CDLL(path or soname, mode=mode)


def _declare(library: ctypes.CDLL, signatures: dict) -> None:
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(library, name)
        fn.restype, fn.argtypes = restype, argtypes


def _load() -> None:
    with _lock:
        if _state:
            return
        path = _search(("nvidia/cublasmp/cu13/lib",), _SONAME)
        if path is None:
            _state["error"] = f"{PACKAGE} is not installed ({_INSTALL_HINT}): no {_SONAME} on sys.path"
            return
        try:
            importlib.import_module("torch")  # torch's CUDA libraries first, so theirs are the ones reused

            deps = {so: _load_once(so, dirs) for so, dirs in _DEPENDENCIES.items()}
            library = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            _declare(library, SIGNATURES)
            _declare(deps["libnccl.so.2"], _NCCL_SIGNATURES)
            _declare(deps["libnvshmem_host.so.3"], _NVSHMEM_SIGNATURES)
        except (OSError, AttributeError) as error:
            text = str(error)
            hint = (" (cuBLASMp >= 0.8 needs NCCL >= 2.29; use 0.7 with torch 2.11's NCCL 2.28)"
                    if "undefined symbol" in text and "nccl" in text else "")
            _state["error"] = f"{PACKAGE} found at {path} but failed to load: {error}{hint}"
            return
        _state.update(lib=library, nccl=deps["libnccl.so.2"], nvshmem=deps["libnvshmem_host.so.3"], path=path)


def status() -> str | None:
    """``None`` when cuBLASMp and its dependencies load, else why not."""
    _load()
    return _state.get("error")


def _get(name: str):
    reason = status()
    if reason:
        raise RuntimeError(reason)
    return _state[name]


def lib() -> ctypes.CDLL:
    return _get("lib")


def nccl() -> ctypes.CDLL:
    return _get("nccl")


def nvshmem() -> ctypes.CDLL:
    return _get("nvshmem")


def version() -> int:
    """``cublasMpGetVersion`` (0.7.0 -> 700)."""
    value = ctypes.c_int()
    check(lib().cublasMpGetVersion(ctypes.byref(value)), "cublasMpGetVersion")
    return value.value


def describe() -> str:
    """One line for ``doctor``."""
    reason = status()
    if reason:
        return f"not available: {reason}"
    v = version()
    return f"{PACKAGE}: cuBLASMp {v // 1000}.{v // 100 % 10}.{v % 100} ({_state['path']})"


def check(code: int, what: str) -> None:
    """Raise ``RuntimeError`` naming the call unless ``code`` is ``CUBLASMP_STATUS_SUCCESS``."""
    if code != 0:
        raise RuntimeError(f"cuBLASMp {what} failed: CUBLASMP_STATUS_{_STATUS.get(code, code)}")


def check_nccl(code: int, what: str) -> None:
    if code != 0:
        message = nccl().ncclGetErrorString(code)
        raise RuntimeError(f"NCCL {what} failed ({code}): {message.decode() if message else '?'}")


def _reset_for_tests(error: str | None = None) -> None:
    """Forget the load result; with ``error``, pretend loading failed with it (tests only)."""
    with _lock:
        _state.clear()
        if error is not None:
            _state["error"] = error
