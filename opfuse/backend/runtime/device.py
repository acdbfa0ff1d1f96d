"""Per-device facts the implementations read on their hot paths, computed once per process."""

from __future__ import annotations

import functools
import importlib.util

import torch

__all__ = ["sm_count", "current_stream", "is_capturing", "triton_status"]

_SM_COUNT: dict[int, int] = {}


def sm_count(index: int | None = None) -> int:
    """Multiprocessors of CUDA device ``index`` (default: the current device)."""
    if index is None:
        index = torch.cuda.current_device()
    count = _SM_COUNT.get(index)
    if count is None:
        count = _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def current_stream() -> int:
    """The current stream's raw handle, straight from C (``torch.cuda.current_stream()`` builds a
    Python object, which costs several microseconds of host time per call on the GPU hosts)."""
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())


def is_capturing() -> bool:
    """Whether the current stream is being captured into a CUDA graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=None)
def triton_status() -> str | None:
    """``None`` if triton (>= 3.0) can be imported, else why not."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        import triton
    except Exception as error:  # noqa: BLE001 - a broken install is a reason, not a crash
        return f"import triton failed: {error}"
    if int(triton.__version__.split(".")[0]) < 3:
        return f"triton {triton.__version__} is too old (3.0 or newer needed)"
    return None
