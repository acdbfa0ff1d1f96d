"""Per-device facts the implementations read on their hot paths, computed once per process."""

from __future__ import annotations

import functools
import importlib.util

import torch

__all__ = ["dtype_name", "sm_count", "device_name", "current_stream", "is_capturing", "triton_status",
           "triton_gpu_reason"]

_SM_COUNT: dict[int, int] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16`` (what messages print)."""
    return str(dtype).replace("torch.", "")


def sm_count(index: int | None = None) -> int:
    """Multiprocessors of CUDA device ``index`` (default: the current device)."""
    if index is None:
        index = torch.cuda.current_device()
    count = _SM_COUNT.get(index)
    if count is None:
        count = _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


@functools.lru_cache(maxsize=None)
def _name_of(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device) -> str | None:
    """The driver's name of a CUDA device (``NVIDIA H100 80GB HBM3``; read once per device), the key
    of opfuse's per-GPU measured tables; ``None`` for other devices or without CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _name_of(torch.cuda.current_device() if device.index is None else device.index)


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


def triton_gpu_reason(spec, dtypes: tuple[torch.dtype, ...], min_major: int) -> str | None:
    """The conditions every opfuse Triton kernel shares: a CUDA device of compute capability
    ``min_major``.0 or newer, triton importable, ``x`` (and the weight, when the op has one) of one
    dtype in ``dtypes``. Pure: reads the spec and cached device facts."""
    if spec.device.type != "cuda":
        return "needs a CUDA device"
    reason = triton_status()
    if reason:
        return reason
    if spec.dtype not in dtypes:
        accepted = ", ".join(dtype_name(d) for d in dtypes)
        return f"dtype {dtype_name(spec.dtype)} not supported ({accepted})"
    weight = spec.inputs.get("weight")
    if weight is not None and weight.dtype != spec.dtype:
        return f"weight dtype {dtype_name(weight.dtype)} differs from x dtype {dtype_name(spec.dtype)}"
    major, minor = torch.cuda.get_device_capability(spec.device)
    if major < min_major:
        return f"compute capability {major}.{minor} < {min_major}.0"
    return None
