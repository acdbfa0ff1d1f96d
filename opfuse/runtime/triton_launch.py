"""``launch(kernel, grid, *args, **meta)``: ``kernel[grid](*args, **meta)`` for opfuse's own Triton
kernels, with the compiled kernel looked up in a dict keyed by what Triton specializes on.

Triton's ``JITFunction.run`` binds the arguments through a generated function, specializes every
one of them (dtype, 16-byte alignment, integer value classes), joins the specialization into a
string key and builds launch metadata on every call: about 35 us of host time per launch more than
calling the compiled kernel's launcher (docs/PERF_NOTES.md, "Triton launches"). A compiled FP8
graph launches opfuse's kernels (norm + quantize, weight and activation casts) tens to hundreds of
times per step, and small FP8 models are host-bound without CUDA graphs.

Here the key is computed from the arguments directly: a constexpr by its value; a tensor by its
dtype and whether its address is 16-byte aligned; an integer by whether it is 1, whether it
divides by 16 and its width class; floats and ``None`` by type, booleans by value; keywords that are not
parameters (``num_warps``, ...) by value. That key is at least as fine as Triton's own
(``tests/unit/test_triton_launch.py`` checks it against Triton's specializer), so a hit runs the
kernel Triton itself would have chosen. A miss, and every call this cannot key (a callable grid,
an autotuned or interpreted kernel, an argument of another type, a launch hook a profiler
installed, a call Dynamo traces), goes through ``kernel[grid]`` unchanged; a miss then caches the
compiled kernel Triton returns. ``OPFUSE_TRITON_LAUNCH_CACHE=0`` turns the lookup off.
"""

from __future__ import annotations

import torch

from ..config import config

__all__ = ["launch", "cache_size", "clear_cache"]

_INT32 = (-(1 << 31), 1 << 31)
_INT64 = (-(1 << 63), 1 << 63)


class _Uncacheable(Exception):
    pass


class _Signature:
    """A JIT function's parameter names, defaults and which are ``tl.constexpr``, read once."""

    __slots__ = ("names", "known", "defaults", "constexpr", "count")

    def __init__(self, fn):
        self.names = tuple(fn.arg_names)
        self.known = frozenset(self.names)
        self.count = len(self.names)
        self.constexpr = tuple(bool(p.is_constexpr) for p in fn.params)
        self.defaults = {}
        for name, param in fn.signature.parameters.items():
            if param.default is not param.empty:
                self.defaults[name] = param.default


_SIGNATURES: dict[int, _Signature] = {}
_COMPILED: dict[tuple, object] = {}
_JIT_TYPE = None  # triton.runtime.jit.JITFunction, imported on first use
_KNOBS = None


def _jit_type():
    global _JIT_TYPE, _KNOBS
    if _JIT_TYPE is None:
        from triton import knobs
        from triton.runtime.jit import JITFunction

        _JIT_TYPE, _KNOBS = JITFunction, knobs
    return _JIT_TYPE


def _hooked(hook) -> bool:
    """Whether a launch hook is installed (a profiler's): those launches keep Triton's own path,
    which builds the metadata hooks read. Triton 3.6 keeps an empty ``HookChain`` when none is."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _spec(value):
    """What Triton may specialize ``value`` on (a superset of it)."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    kind = type(value)
    if kind is bool:
        return value
    if kind is int:
        return ("i", value == 1, value % 16 == 0, _INT32[0] <= value < _INT32[1], _INT64[0] <= value < _INT64[1],
                value >= 0)
    if kind is float:
        return "f"
    if value is None:
        return None
    raise _Uncacheable


def _device() -> int:
    """The device Triton launches on: the current one (``JITFunction.run`` reads the same)."""
    return torch.cuda.current_device()


def _signature(fn) -> _Signature:
    sig = _SIGNATURES.get(id(fn))
    if sig is None:
        sig = _SIGNATURES[id(fn)] = _Signature(fn)
    return sig


def _key_and_values(fn, args, meta):
    sig = _signature(fn)
    if len(args) > sig.count:
        raise _Uncacheable
    values = list(args)
    for name in sig.names[len(args):]:
        if name in meta:
            values.append(meta[name])
        elif name in sig.defaults:
            values.append(sig.defaults[name])
        else:
            raise _Uncacheable  # a missing argument: Triton's own path says which
    # A constexpr is part of the kernel: keyed by value; any other argument by what it may be
    # specialized on; keywords that are not parameters (num_warps, ...) are options, by value.
    specs = tuple(v if constexpr else _spec(v) for v, constexpr in zip(values, sig.constexpr))
    options = tuple(item for item in meta.items() if item[0] not in sig.known)
    key = (id(fn), _device(), _KNOBS.runtime.debug, specs, options)
    hash(key)  # an unhashable constexpr or option: TypeError, Triton's own path
    return key, values


def launch(kernel, grid, *args, **meta):
    """Run ``kernel[grid](*args, **meta)`` (same arguments, same result), reusing the compiled
    kernel of an earlier call with the same specialization without Triton's per-call binding."""
    jit = _jit_type()
    runtime = _KNOBS.runtime
    if (not config.triton_launch_cache or type(kernel) is not jit or callable(grid) or kernel.pre_run_hooks
            or torch.compiler.is_compiling() or _hooked(runtime.launch_enter_hook)
            or _hooked(runtime.launch_exit_hook)):
        return kernel[grid](*args, **meta)
    try:
        key, values = _key_and_values(kernel, args, meta)
    except (_Uncacheable, TypeError):
        return kernel[grid](*args, **meta)
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = kernel[grid](*args, **meta)
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        if compiled is not None and getattr(compiled, "function", None) is not None:
            _COMPILED[key] = compiled
        return compiled
    size = len(grid)
    stream = torch._C._cuda_getCurrentRawStream(key[1])
    compiled.run(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, stream, compiled.function,
                 compiled.packed_metadata, None, None, None, *values)
    return compiled


def cache_size() -> int:
    """Compiled kernels held for cached launches."""
    return len(_COMPILED)


def clear_cache() -> None:
    """Forget every cached compiled kernel (the next launch of each goes through Triton again)."""
    _COMPILED.clear()
