"""Per-device facts the implementations read on their hot paths, computed once per process."""

from __future__ import annotations

import functools
import importlib.util
import sys
import threading

import torch

__all__ = ["dtype_name", "sm_count", "device_name", "current_stream", "is_capturing", "allocating_to_graph_pool",
           "outside_graph_pool", "triton_status", "triton_gpu_reason"]

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


def _cudagraph_tree_stream(index: int):
    """The stream the cudagraph tree of device ``index`` warms up and records on (torch.compile's
    ``mode="reduce-overhead"``), or ``None`` when this thread has no tree there. Nothing is created:
    a process that never compiled with CUDA graphs has not imported the module."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return None
    try:  # the thread's own state, or the one autograd's threads inherit; never initialised from here
        containers = getattr(trees.local, "tree_manager_containers", None)
        if containers is None and torch._C._is_key_in_tls("tree_manager_containers"):
            containers = torch._C._get_obj_in_tls("tree_manager_containers")
    except Exception:  # noqa: BLE001 - a torch whose trees keep their state elsewhere has none to find here
        return None
    if containers is None:
        return None
    manager = getattr(containers.get(index), "tree_manager", None)
    return getattr(manager, "stream", None)


def allocating_to_graph_pool() -> bool:
    """Whether this thread's CUDA allocations now come from a CUDA graph's private pool: during a
    capture, and while a cudagraph tree warms up or records a compiled graph (it runs the graph on
    its own stream with the pool on). A tensor made then and kept past the call (a cache entry, a
    per-weight hint) is one the tree does not track: it fails the tree's pool check, and a replay
    may overwrite it."""
    if not torch.cuda.is_available():
        return False
    if torch.cuda.is_current_stream_capturing():
        return True
    index = torch.cuda.current_device()
    stream = _cudagraph_tree_stream(index)
    return stream is not None and torch._C._cuda_getCurrentRawStream(index) == stream.cuda_stream


def outside_graph_pool(make):
    """``make()`` with its allocations from the ordinary caching allocator although this thread
    allocates to a graph pool (a cudagraph tree's warm-up): it runs on a helper thread (pools are
    routed per thread and per stream; the helper has neither), which waits for its own kernels
    before it returns. For small, long-lived state made on first use. Not during a capture: the
    capture would not contain the helper's kernels."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("opfuse: outside_graph_pool() during a CUDA-graph capture; make the state before capturing")
    device = torch.cuda.current_device()
    result, errors = [], []

    def run():
        try:
            with torch.cuda.device(device):
                result.append(make())
                torch.cuda.current_stream(device).synchronize()
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(error)

    helper = threading.Thread(target=run, name="opfuse-outside-graph-pool")
    helper.start()
    helper.join()
    if errors:
        raise errors[0]
    return result[0]


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
