"""The cached Triton launch path (opfuse/runtime/triton_launch.py): its key is at least as fine as
Triton's own specialization, constexprs and options are keyed by value, and every call it cannot
key goes through ``kernel[grid]`` unchanged. (The launches themselves: tests/gpu/test_triton_launch.py.)"""

from __future__ import annotations

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from opfuse import config  # noqa: E402
from opfuse.runtime import triton_launch  # noqa: E402


@triton.jit
def _probe_kernel(x_ptr, out_ptr, n, scale, FLAG: tl.constexpr, BLOCK: tl.constexpr = 64):
    pass


def _native(value):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, value, False, True, True)


def _samples():
    ints = [0, 1, 2, 15, 16, 17, 32, 2**31 - 1, 2**31, 2**31 + 16, -1, -16, -2**31, -2**31 - 1, 2**63 - 1, 2**63,
            2**64 - 1]
    base = torch.zeros(64, dtype=torch.uint8)
    tensors = [base[offset:offset + 16].view(dtype)
               for offset in (0, 1, 2, 8, 16, 32) for dtype in (torch.uint8, torch.float16)
               if offset % torch.empty((), dtype=dtype).element_size() == 0]
    tensors += [torch.zeros(4, dtype=d) for d in (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int64)]
    return ints + [0.0, 1.0, -2.5, 1e30, True, False, None] + tensors


def test_key_is_at_least_as_fine_as_tritons_specialization():
    """Two values with the same key must get the same specialization from Triton (else a cached
    kernel compiled for one would run the other)."""
    samples = _samples()
    for a, b in itertools.combinations(samples, 2):
        if triton_launch._spec(a) == triton_launch._spec(b):
            assert _native(a) == _native(b), (a, b, triton_launch._spec(a))


def test_tensors_keyed_by_dtype_and_alignment_not_address():
    x, y = torch.zeros(32, dtype=torch.float16), torch.zeros(64, dtype=torch.float16)
    assert triton_launch._spec(x) == triton_launch._spec(y)
    assert triton_launch._spec(y[1:]) != triton_launch._spec(y)
    assert triton_launch._spec(y.to(torch.bfloat16)) != triton_launch._spec(y)


@pytest.fixture
def on_device_zero(monkeypatch):
    monkeypatch.setattr(triton_launch, "_device", lambda: 0)
    triton_launch._jit_type()


def _key(*args, **meta):
    return triton_launch._key_and_values(_probe_kernel, args, meta)


def test_key_and_launch_values(on_device_zero):
    x, out = torch.zeros(16), torch.zeros(16)
    key, values = _key(x, out, 16, 0.5, FLAG=True)
    # Every parameter in order, the default filled in; the values are what the launcher takes.
    assert values == [x, out, 16, 0.5, True, 64]
    assert _key(torch.ones(16), torch.ones(16), 32, 2.0, FLAG=True)[0] == key  # same specialization
    assert _key(x, out, 17, 0.5, FLAG=True)[0] != key  # 17 is not a multiple of 16
    assert _key(x, out, 16, 0.5, FLAG=False)[0] != key  # constexpr by value
    assert _key(x, out, 16, 0.5, FLAG=True, BLOCK=128)[0] != key
    assert _key(x, out, 16, 0.5, FLAG=True, num_warps=8)[0] != key  # an option by value
    assert _key(x, out, 16, 0.5, FLAG=True, num_warps=8)[0] == _key(x, out, 16, 0.5, FLAG=True, num_warps=8)[0]


def test_unkeyable_calls_are_refused(on_device_zero):
    x = torch.zeros(16)
    with pytest.raises(triton_launch._Uncacheable):
        _key(x, x, 16)  # scale and FLAG missing: Triton's own path reports it
    with pytest.raises(triton_launch._Uncacheable):
        _key(x, x, 16, 0.5, True, 64, 1)  # too many arguments
    with pytest.raises(triton_launch._Uncacheable):
        _key(x, x, torch.tensor(3).numpy(), 0.5, FLAG=True)  # a numpy scalar: not keyed
    with pytest.raises(TypeError):
        _key(x, x, 16, 0.5, FLAG=[1])  # an unhashable constexpr


class _Recorder:
    """Stands in for a kernel that is not a JITFunction (an autotuner, the interpreter's)."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.calls.append((grid, args, meta)) or "ran"


def test_other_kernels_and_callable_grids_take_tritons_path(on_device_zero):
    kernel = _Recorder()
    assert triton_launch.launch(kernel, (3,), 1, 2, FLAG=True) == "ran"
    assert kernel.calls == [((3,), (1, 2), {"FLAG": True})]
    before = triton_launch.cache_size()
    calls = []
    _probe_kernel_getitem = type(_probe_kernel).__getitem__
    try:
        type(_probe_kernel).__getitem__ = lambda self, grid: (lambda *a, **m: calls.append(grid))
        grid = lambda meta: (1,)  # noqa: E731
        triton_launch.launch(_probe_kernel, grid, torch.zeros(1), torch.zeros(1), 1, 0.5, FLAG=True)
        with config.override(triton_launch_cache=False):
            triton_launch.launch(_probe_kernel, (2,), torch.zeros(1), torch.zeros(1), 1, 0.5, FLAG=True)
    finally:
        type(_probe_kernel).__getitem__ = _probe_kernel_getitem
    assert calls == [grid, (2,)]
    assert triton_launch.cache_size() == before  # nothing compiled, nothing cached


def test_setting_from_the_environment():
    try:
        config.reload_from_env({"OPFUSE_TRITON_LAUNCH_CACHE": "0"})
        assert config.triton_launch_cache is False
        with pytest.raises(ValueError, match="OPFUSE_TRITON_LAUNCH_CACHE='maybe'"):
            config.reload_from_env({"OPFUSE_TRITON_LAUNCH_CACHE": "maybe"})
    finally:
        config.reload_from_env()
