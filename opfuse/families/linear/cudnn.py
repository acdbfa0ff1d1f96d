"""``linear_bias_activation`` through one cuDNN frontend graph (``pip install opfuse[cudnn]``):
``matmul -> bias -> gelu`` (exact or tanh GELU), fused by cuDNN's runtime-fusion engines, the
pre-activation kept in float32 inside the kernel. With gradients the graph also writes the
pre-activation (``bias`` output) for the backward, which is the reference's (torch ops).

The capability check asks cuDNN whether it has an engine for the graph on this GPU (host side,
cached per shape and dtype); ``prepare`` compiles it; a call executes it on the current stream.
"""

from __future__ import annotations

import torch

from ...runtime import cudnn_frontend as frontend
from ...runtime.device import is_capturing

__all__ = ["NAME", "check", "prepare", "forward", "build"]

NAME = "cudnn"
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
X, W, B, Y, PRE = 1, 2, 3, 10, 11
_GELU = {"gelu": "gelu", "gelu_tanh": "gelu_approx_tanh"}


def build(cudnn, h, *, rows: int, k: int, n: int, dtype: torch.dtype, activation: str, save_pre: bool):
    """``y = gelu(x @ w.T + b)`` for ``x [rows, K]``, ``w [N, K]`` (read as its transpose, no copy),
    ``b [N]``; ``save_pre`` also writes ``x @ w.T + b``."""
    io = frontend.data_type(dtype)
    g = cudnn.pygraph(handle=h, io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)
    x = g.tensor(name="x", dim=[1, rows, k], stride=[rows * k, k, 1], data_type=io, uid=X)
    w = g.tensor(name="w_t", dim=[1, k, n], stride=[n * k, 1, k], data_type=io, uid=W)
    b = g.tensor(name="bias", dim=[1, 1, n], stride=[n, n, 1], data_type=io, uid=B)
    acc = g.matmul(x, w, name="matmul")
    acc.set_data_type(cudnn.data_type.FLOAT)
    pre = g.bias(input=acc, bias=b, name="bias")
    y = getattr(g, _GELU[activation])(input=pre, name="activation")
    y.set_uid(Y).set_output(True).set_data_type(io)
    if save_pre:
        pre.set_uid(PRE).set_output(True).set_data_type(io)
    else:
        pre.set_data_type(cudnn.data_type.FLOAT)
    return g


def _key(device, rows, k, n, dtype, activation, save_pre):
    return ("linear_bias_activation", device, rows, k, n, dtype, activation, save_pre)


def _graph(spec):
    w = spec.inputs["weight"]
    device = spec.device.index if spec.device.index is not None else torch.cuda.current_device()
    shape = dict(rows=spec.x.tokens, k=spec.x.features, n=w.shape[0], dtype=spec.dtype,
                 activation=spec.attrs["activation"], save_pre=spec.requires_grad)
    return _key(device, *shape.values()), device, lambda cudnn, h: build(cudnn, h, **shape)


def check(spec) -> str | None:
    """Capable on CUDA for bfloat16/float16 when every operand has the input's dtype and cuDNN
    has an engine for the fused graph here."""
    if spec.attrs["activation"] not in _GELU:
        return f"activation {spec.attrs['activation']!r} has no cuDNN graph here (accepted: {sorted(_GELU)})"
    reason = frontend.spec_reason(spec, SUPPORTED_DTYPES, ("weight", "bias"))
    if reason:
        return reason
    key, device, builder = _graph(spec)
    if is_capturing() and frontend.cached_plan(key) is None:
        return "cuDNN graphs cannot be built during CUDA-graph capture"
    return frontend.supported(key, device, builder)


def prepare(spec) -> None:
    key, device, builder = _graph(spec)
    frontend.plan(key, device, builder)


def forward(x, weight, bias, activation, save_pre):
    """``(gelu(x @ w.T + b), pre-activation or empty)``."""
    k, n = x.shape[-1], weight.shape[0]
    rows = x.numel() // k
    key = _key(x.device.index, rows, k, n, x.dtype, activation, bool(save_pre))
    compiled = frontend.cached_plan(key)
    if compiled is None:  # a call outside a program (tests, benchmarks): build on first use
        shape = dict(rows=rows, k=k, n=n, dtype=x.dtype, activation=activation, save_pre=bool(save_pre))
        compiled = frontend.plan(key, x.device.index, lambda cudnn, h: build(cudnn, h, **shape))
    out_shape = tuple(x.shape[:-1]) + (n,)
    y = x.new_empty(out_shape)
    buffers = {X: x.contiguous(), W: weight.contiguous(), B: bias.contiguous(), Y: y}
    pre = x.new_empty(out_shape) if save_pre else x.new_empty(0)
    if save_pre:
        buffers[PRE] = pre
    frontend.execute(compiled, buffers)
    return y, pre
