"""Which backward the residual-norm family's ``cuda`` implementations run, and how its operands
reach the kernels (a recording stand-in for the CUDA extension; the kernels' numerics are checked
in tests/gpu/test_residual_norm_kernels.py)."""

import pytest
import torch

from opfuse.families.residual_norm import cuda as norm_cuda
from opfuse.families.residual_norm import reference


class _Recorder:
    DTYPES = {"float32": 0, "bfloat16": 1, "float16": 2}

    def __init__(self):
        self.calls = []

    def rms_norm_backward(self, dy, h, weight, dh_out, dh, partial, dw, tokens, hidden, eps, dtype, blocks, stream):
        self.calls.append(("rms", dict(dy=dy, h=h, weight=weight, dh_out=dh_out, dh=dh, partial=partial, dw=dw,
                                       tokens=tokens, hidden=hidden, dtype=dtype, blocks=blocks)))

    def layer_norm_backward(self, dy, h, weight, dh_out, dh, partial, dw, db, tokens, hidden, eps, dtype, blocks,
                            stream):
        self.calls.append(("layer", dict(dy=dy, h=h, weight=weight, dh_out=dh_out, dh=dh, partial=partial, dw=dw,
                                         db=db, tokens=tokens, hidden=hidden, dtype=dtype, blocks=blocks)))


@pytest.fixture
def kernels(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(norm_cuda.extension, "load", lambda family: recorder)
    monkeypatch.setattr(norm_cuda, "sm_count", lambda: 4)
    monkeypatch.setattr(norm_cuda, "current_stream", lambda: 0)
    partials = []
    empty = torch.empty

    def recording_empty(*shape, **kwargs):  # the float32 scratch the kernel gets
        t = empty(*shape, **kwargs)
        if kwargs.get("dtype") == torch.float32:
            partials.append(t)
        return t

    monkeypatch.setattr(norm_cuda.torch, "empty", recording_empty)
    recorder.partials = partials
    return recorder


def _operands(tokens, hidden, dtype=torch.bfloat16, weight=True, bias=True, extra=True):
    rnd = lambda *s: torch.randn(*s).to(dtype)  # noqa: E731
    return (rnd(tokens, hidden), rnd(tokens, hidden), rnd(tokens, hidden) if extra else None,
            rnd(hidden) if weight else None, rnd(hidden) if bias else None)


@pytest.mark.parametrize("hidden", [64, 1001])  # packed rows and odd ones: LayerNorm takes both
@pytest.mark.parametrize("weight,bias", [(True, True), (True, False), (False, True), (False, False)])
def test_layernorm_backward_runs_the_kernel(kernels, hidden, weight, bias):
    dy, h, dh_out, w, b = _operands(10, hidden, weight=weight, bias=bias)
    dh, dw, db = norm_cuda.norm_backward(dy, h, dh_out, w, b, 1e-5, norm="layer")
    [(kind, call)] = kernels.calls
    assert kind == "layer" and call["tokens"] == 10 and call["hidden"] == hidden and call["blocks"] == 8
    assert (call["dy"], call["h"], call["dh_out"], call["dh"]) == (dy.data_ptr(), h.data_ptr(), dh_out.data_ptr(),
                                                                   dh.data_ptr())
    assert dh.shape == h.shape and dh.dtype == h.dtype
    assert call["weight"] == (w.data_ptr() if weight else 0)
    assert call["dw"] == (dw.data_ptr() if weight else 0) and dw.shape == ((hidden,) if weight else (0,))
    assert call["db"] == (db.data_ptr() if bias else 0) and db.shape == ((hidden,) if bias else (0,))
    if weight or bias:  # [2, blocks, hidden] float32 scratch
        [partial] = kernels.partials
        assert call["partial"] == partial.data_ptr() and partial.shape == (2, 8, hidden)
    else:
        assert call["partial"] == 0 and not kernels.partials


def test_rmsnorm_backward_keeps_its_kernel_and_sends_unpacked_rows_to_the_reference(kernels):
    dy, h, dh_out, w, _ = _operands(3, 64)
    dh, dw, db = norm_cuda.norm_backward(dy, h, dh_out, w, None, 1e-6, norm="rms")
    [(kind, call)] = kernels.calls
    assert kind == "rms" and call["dw"] == dw.data_ptr() and call["blocks"] == 3 and db.numel() == 0
    kernels.calls.clear()
    dy, h, dh_out, w, _ = _operands(3, 1001)  # 2002-byte rows: not whole 16-byte packs
    got = norm_cuda.norm_backward(dy, h, dh_out, w, None, 1e-6, norm="rms")
    assert not kernels.calls
    for a, b in zip(got, reference.backward(dy, h, dh_out, w, None, 1e-6, norm="rms")):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["fp32 weight", "fp32 norm bias", "fp32 residual gradient", "no rows", "float64"])
def test_operands_the_kernels_cannot_take_get_the_reference(kernels, case):
    dy, h, dh_out, w, b = _operands(0 if case == "no rows" else 4, 64,
                                    dtype=torch.float64 if case == "float64" else torch.bfloat16)
    if case == "fp32 weight":
        w = w.float()
    elif case == "fp32 norm bias":
        b = b.float()
    elif case == "fp32 residual gradient":
        dh_out = dh_out.float()
    got = norm_cuda.norm_backward(dy, h, dh_out, w, b, 1e-5, norm="layer")
    assert not kernels.calls
    for a, want in zip(got, reference.backward(dy, h, dh_out, w, b, 1e-5, norm="layer")):
        assert torch.equal(a, want)
