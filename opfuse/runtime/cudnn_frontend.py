"""The cuDNN frontend (``pip install opfuse[cudnn]``, package ``nvidia-cudnn-frontend``) as an
optional library: importing it, one cuDNN handle per device, and a cache of graphs.

Nothing here imports ``cudnn`` at module import: :func:`status` does it once, on first use, and
a missing or broken package becomes a reason string ("not capable"), never an import error.

The handle of a device is shared by every thread, under a lock: a plan runs with the handle it
was built with, and autograd runs backward on its own thread. A graph goes through two steps, so
that capability checks stay cheap and truthful:

1. :func:`supported` (from a capability check): build the graph's IR, ``validate``,
   ``build_operation_graph``, ``create_execution_plans`` and ``check_support``: cuDNN's own answer
   to "is there an engine for this graph on this GPU and backend", host side only (the first
   query on a device creates that device's cuDNN handle). Cached per key, answer and graph.
2. :func:`plan` (from ``prepare``, or the first call): ``build_plans`` (kernel compilation) and
   the workspace size. Cached per key; a call only looks it up and runs ``execute`` on the current
   stream, which neither synchronises nor allocates beyond its workspace (from torch's allocator,
   so CUDA-graph capture takes it from the graph's pool).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import torch

__all__ = ["PACKAGE", "status", "module", "describe", "backend_version", "data_type", "spec_reason", "handle",
           "Plan", "supported", "plan", "cached_plan", "execute", "clear"]

PACKAGE = "nvidia-cudnn-frontend"
_INSTALL_HINT = "pip install opfuse[cudnn]"

_lock = threading.Lock()
_module: Any = None
_error: str | None = None
_loaded = False


def _load() -> None:
    global _module, _error, _loaded
    with _lock:
        if _loaded:
            return
        try:
            import cudnn  # noqa: PLC0415 - optional dependency, imported on first use only
        except ImportError as error:
            _error = f"{PACKAGE} is not installed ({_INSTALL_HINT}): {error}"
        except Exception as error:  # noqa: BLE001 - a broken install must not break opfuse
            _error = f"{PACKAGE} failed to import: {type(error).__name__}: {error}"
        else:
            _module = cudnn
        _loaded = True


def status() -> str | None:
    """``None`` when the frontend imports, else why not (with the install hint)."""
    _load()
    return _error


def module():
    """The imported ``cudnn`` module; ``RuntimeError`` with :func:`status`'s reason otherwise."""
    reason = status()
    if reason:
        raise RuntimeError(reason)
    return _module


def backend_version() -> int | None:
    """cuDNN backend version as an integer (9.19.0 -> 91900), ``None`` when unknown here (no
    frontend, or no libcudnn loadable on this machine)."""
    if status():
        return None
    try:
        return int(_module.backend_version())
    except Exception:  # noqa: BLE001 - no libcudnn on a CPU machine
        return None


def describe() -> str:
    """One line for ``doctor``."""
    reason = status()
    if reason:
        return f"not available: {reason}"
    version = backend_version()
    backend = "unknown (libcudnn not loadable here)" if version is None else \
        f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    return f"{PACKAGE} {_module.__version__}, cuDNN backend {backend}"


def data_type(dtype: torch.dtype):
    """The cuDNN data type of a torch dtype."""
    cudnn = module()
    table = {torch.float32: cudnn.data_type.FLOAT, torch.bfloat16: cudnn.data_type.BFLOAT16,
             torch.float16: cudnn.data_type.HALF, torch.int32: cudnn.data_type.INT32}
    try:
        return table[dtype]
    except KeyError:
        raise TypeError(f"cuDNN frontend: no data type for {dtype}; accepted: {sorted(map(str, table))}") from None


def spec_reason(spec, dtypes, operands=()) -> str | None:
    """What every cuDNN implementation checks first (pure): a CUDA device, the input's dtype in
    ``dtypes``, each of the ``operands`` present in the input's dtype (one dtype per graph), some
    tokens, and the frontend importing."""
    if spec.device.type != "cuda":
        return "needs a CUDA device"
    if spec.dtype not in dtypes:
        return f"dtype {_name(spec.dtype)} not supported ({', '.join(_name(d) for d in dtypes)})"
    for operand in operands:
        meta = spec.inputs.get(operand)
        if meta is not None and meta.dtype != spec.dtype:
            return f"{operand} is {_name(meta.dtype)}, input is {_name(spec.dtype)} (one dtype per graph)"
    if spec.x.tokens == 0:
        return "no tokens"
    return status()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_handles: dict[int, Any] = {}
# One handle per device for every thread: a plan is executed with the handle it was built with
# (autograd runs backward on its own thread). Calls hold this lock from binding the stream to the
# launch, as a cuDNN handle must not be used by two threads at once.
_handle_lock = threading.RLock()


def handle(device: torch.device | int):
    """The cuDNN handle of ``device``, bound to the current stream (the frontend skips
    ``cudnnSetStream`` when the stream did not change). Callers hold ``_handle_lock``."""
    cudnn = module()
    index = device if isinstance(device, int) else (device.index if device.index is not None else
                                                    torch.cuda.current_device())
    with _handle_lock:
        h = _handles.get(index)
        if h is None:
            with torch.cuda.device(index):
                h = _handles[index] = cudnn.create_handle()
        cudnn.set_stream(handle=h, stream=torch.cuda.current_stream(index).cuda_stream)
    return h


@dataclasses.dataclass
class Plan:
    """A compiled graph: ``execute(buffers)`` with ``{uid: tensor}``."""

    graph: Any
    workspace_size: int
    device: int


@dataclasses.dataclass
class _Entry:
    graph: Any = None
    reason: str | None = None
    plan: Plan | None = None


_cache: dict[tuple, _Entry] = {}
#: ``device -> context manager`` making it current (a seam for CPU tests with a fake frontend).
device_scope = torch.cuda.device


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def supported(key: tuple, device: int, build: Callable[[Any, Any], Any]) -> str | None:
    """Whether cuDNN has an engine for the graph ``build(cudnn, handle)`` returns (``None``) or
    why not; host-side planning only, cached by ``key`` (which must identify the graph: shapes,
    dtypes, strides, flags and the device)."""
    entry = _cache.get(key)
    if entry is not None:
        return entry.reason
    reason = status()
    entry = _Entry(reason=reason)
    if reason is None:
        cudnn = module()
        try:
            with _handle_lock, device_scope(device):
                graph = build(cudnn, handle(device))
                graph.validate()
                graph.build_operation_graph()
                graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                graph.check_support()
            entry.graph = graph
        except Exception as error:  # noqa: BLE001 - cuDNN's refusal is an answer, not a crash
            entry.reason = f"cuDNN has no engine for this graph here: {_first_line(error)}"
    _cache[key] = entry
    return entry.reason


def plan(key: tuple, device: int, build: Callable[[Any, Any], Any]) -> Plan:
    """The compiled plan of a supported graph (compiled on first request; never during capture)."""
    if supported(key, device, build) is not None:
        raise RuntimeError(_cache[key].reason)
    entry = _cache[key]
    if entry.plan is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("cuDNN graph not compiled before CUDA-graph capture (the program prepares it; "
                               "run the block once before capturing)")
        with _handle_lock, device_scope(device):
            handle(device)
            entry.graph.build_plans()
            entry.plan = Plan(entry.graph, int(entry.graph.get_workspace_size()), device)
    return entry.plan


def cached_plan(key: tuple) -> Plan | None:
    """The compiled plan of ``key`` if :func:`plan` built it (the per-call lookup)."""
    entry = _cache.get(key)
    return None if entry is None else entry.plan


def execute(compiled: Plan, buffers: dict[int, Any]) -> None:
    """Run ``compiled`` on the current stream with ``{uid: tensor}`` (pass-by-value scalars as
    CPU tensors); the workspace comes from torch's caching allocator."""
    workspace = torch.empty(max(compiled.workspace_size, 1), dtype=torch.uint8,
                            device=torch.device("cuda", compiled.device))
    with _handle_lock:
        compiled.graph.execute(buffers, workspace, handle=handle(compiled.device))


def clear() -> None:
    """Forget every cached graph (tests)."""
    _cache.clear()


def _reset_for_tests(fake_module=None, error: str | None = None) -> None:
    """Pretend the frontend is ``fake_module`` (or missing with ``error``); tests only."""
    global _module, _error, _loaded
    with _lock:
        _module, _error, _loaded = fake_module, error, fake_module is not None or error is not None
    _cache.clear()
    _handles.clear()
