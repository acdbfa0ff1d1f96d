"""The ``cudnn`` implementation of ``add_rmsnorm`` / ``add_layernorm`` (one device): cuDNN
frontend norm graphs (``pip install opfuse[cudnn]``).

* Forward: ``h = x [+ bias] [+ residual]`` with torch (cuDNN's norm nodes take their input as
  is), then one cuDNN norm graph in inference phase (no statistics written).
* Backward: the statistics are recomputed from ``h`` (the fused op keeps ``h``, not the
  statistics): RMSNorm's ``1/rms`` with one float32 ``vector_norm`` over the rows, LayerNorm's mean
  and ``1/std`` with cuDNN's training-phase forward (its ``y`` goes to scratch). Then cuDNN's norm
  backward graph; with a residual gradient ``dh_out`` its ``dx`` is written in float32 and summed
  with ``dh_out`` before one rounding (the family's contract).

Graphs are keyed by device, norm, dtype, tokens and hidden size; the capability check asks cuDNN
whether it has engines for them (host side, cached), ``prepare`` compiles them, a call executes
them on the current stream (no host synchronisation; CUDA-graph capturable when cuDNN's engines
are, which the GPU tests check by replaying captured calls on fresh data).
"""

from __future__ import annotations

import functools

import torch

from ...runtime import cudnn_frontend as frontend
from ...runtime.device import is_capturing

__all__ = ["NAME", "check", "prepare", "forward", "backward"]

NAME = "cudnn"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Tensor uids inside every graph below (cuDNN binds buffers by uid).
X, SCALE, BIAS, EPS, Y, MEAN, INV_VAR, DY, DX, DSCALE, DBIAS = 1, 2, 3, 4, 10, 11, 12, 20, 21, 22, 23


# Graphs -------------------------------------------------------------------------------------------


def _rows(g, cudnn, name, uid, tokens, hidden, dtype):
    """A ``[tokens, hidden]`` row-major tensor in cuDNN's norm layout ``[N, C, 1, 1]``."""
    return g.tensor(name=name, dim=[tokens, hidden, 1, 1], stride=[hidden, 1, hidden, hidden],
                    data_type=frontend.data_type(dtype), uid=uid)


def _vector(g, name, uid, hidden, dtype):
    return g.tensor(name=name, dim=[1, hidden, 1, 1], stride=[hidden, 1, hidden, hidden],
                    data_type=frontend.data_type(dtype), uid=uid)


def _stats(g, cudnn, name, uid, tokens):
    return g.tensor(name=name, dim=[tokens, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT, uid=uid)


def _new_graph(cudnn, h):
    return cudnn.pygraph(handle=h, intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT)


def build_forward(cudnn, h, *, norm: str, tokens: int, hidden: int, dtype: torch.dtype, training: bool = False):
    """``y = norm(x) * scale [+ bias]``; ``training`` also writes the statistics (LayerNorm:
    ``mean`` and ``inv_var``; RMSNorm: ``inv_var``), as the backward's recompute needs them."""
    g = _new_graph(cudnn, h)
    x = _rows(g, cudnn, "x", X, tokens, hidden, dtype)
    scale = _vector(g, "scale", SCALE, hidden, dtype)
    eps = g.tensor(name="epsilon", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT,
                   is_pass_by_value=True, uid=EPS)
    phase = cudnn.norm_forward_phase.TRAINING if training else cudnn.norm_forward_phase.INFERENCE
    if norm == "rms":
        y, inv_var = g.rmsnorm(name="rmsnorm", norm_forward_phase=phase, input=x, scale=scale, bias=None,
                               epsilon=eps)
        mean = None
    else:
        bias = _vector(g, "bias", BIAS, hidden, dtype)
        y, mean, inv_var = g.layernorm(name="layernorm", norm_forward_phase=phase, input=x, scale=scale,
                                       bias=bias, epsilon=eps)
    y.set_uid(Y).set_output(True).set_data_type(frontend.data_type(dtype))
    if training:
        inv_var.set_uid(INV_VAR).set_output(True).set_data_type(cudnn.data_type.FLOAT)
        if mean is not None:
            mean.set_uid(MEAN).set_output(True).set_data_type(cudnn.data_type.FLOAT)
    return g


def build_backward(cudnn, h, *, norm: str, tokens: int, hidden: int, dtype: torch.dtype, dx_dtype: torch.dtype):
    """``(dx, dscale[, dbias])`` from ``dy``, ``x`` and the statistics; ``dx`` in ``dx_dtype``."""
    g = _new_graph(cudnn, h)
    dy = _rows(g, cudnn, "dy", DY, tokens, hidden, dtype)
    x = _rows(g, cudnn, "x", X, tokens, hidden, dtype)
    scale = _vector(g, "scale", SCALE, hidden, dtype)
    inv_var = _stats(g, cudnn, "inv_var", INV_VAR, tokens)
    if norm == "rms":
        dx, dscale, _ = g.rmsnorm_backward(name="rmsnorm_backward", grad=dy, input=x, scale=scale,
                                           inv_variance=inv_var, has_dbias=False)
        dbias = None
    else:
        mean = _stats(g, cudnn, "mean", MEAN, tokens)
        dx, dscale, dbias = g.layernorm_backward(name="layernorm_backward", grad=dy, input=x, scale=scale,
                                                 mean=mean, inv_variance=inv_var)
    dx.set_uid(DX).set_output(True).set_data_type(frontend.data_type(dx_dtype))
    dscale.set_uid(DSCALE).set_output(True).set_data_type(frontend.data_type(dtype))
    if dbias is not None:
        dbias.set_uid(DBIAS).set_output(True).set_data_type(frontend.data_type(dtype))
    return g


def _key(kind: str, device: int, norm: str, tokens: int, hidden: int, dtype: torch.dtype, extra=()):
    return ("residual_norm", kind, device, norm, tokens, hidden, dtype) + tuple(extra)


def _graphs(device: int, norm: str, tokens: int, hidden: int, dtype: torch.dtype, training: bool):
    """``[(key, builder, required)]`` of the graphs a program needs: the forward; for training the
    backward with ``dx`` in the input dtype, and two optional ones (used when cuDNN has engines for
    them): the backward with a float32 ``dx`` (a residual gradient is then summed before the one
    rounding; otherwise after cuDNN's) and, for LayerNorm, the statistics recompute (otherwise
    torch's ``native_layer_norm``)."""
    shape = dict(norm=norm, tokens=tokens, hidden=hidden, dtype=dtype)
    graphs = [(_key("forward", device, norm, tokens, hidden, dtype), functools.partial(build_forward, **shape),
               True)]
    if training:
        graphs.append((_key("backward", device, norm, tokens, hidden, dtype, (dtype,)),
                       functools.partial(build_backward, dx_dtype=dtype, **shape), True))
        if dtype != torch.float32:
            graphs.append((_key("backward", device, norm, tokens, hidden, dtype, (torch.float32,)),
                           functools.partial(build_backward, dx_dtype=torch.float32, **shape), False))
        if norm == "layer":
            graphs.append((_key("stats", device, norm, tokens, hidden, dtype),
                           functools.partial(build_forward, training=True, **shape), False))
    return graphs


# Capability check (pure: reads metadata and cuDNN's cached support answers) and prepare -------------


def _spec_graphs(spec):
    return _graphs(spec.device.index if spec.device.index is not None else torch.cuda.current_device(),
                   spec.attrs["norm"], spec.x.tokens, spec.x.features, spec.dtype, spec.requires_grad)


def check(spec) -> str | None:
    """Capable on CUDA for float32/bfloat16/float16 with a norm weight of the input's dtype, when
    the frontend imports and cuDNN has engines for the program's graphs."""
    if spec.inputs.get("weight") is None:
        return "the cuDNN norm graphs here take a norm weight (the norm has elementwise_affine=False)"
    reason = frontend.spec_reason(spec, SUPPORTED_DTYPES, ("residual", "bias", "weight", "norm_bias"))
    if reason:
        return reason
    graphs = _spec_graphs(spec)
    if is_capturing() and any(required and frontend.cached_plan(key) is None for key, _, required in graphs):
        return "cuDNN graphs cannot be built during CUDA-graph capture"
    device = graphs[0][0][2]
    for key, build, required in graphs:
        reason = frontend.supported(key, device, build)  # optional graphs: asked too, the answer is cached
        if reason and required:
            return f"{key[1]} graph: {reason}"
    return None


def prepare(spec) -> None:
    """Compile the program's graphs (kernel builds happen here, not on the first call)."""
    for key, build, required in _spec_graphs(spec):
        if required or frontend.supported(key, key[2], build) is None:
            frontend.plan(key, key[2], build)


def _plan(kind, x, norm, extra=()):
    """``(compiled plan or None when cuDNN has no engine for an optional graph, tokens, hidden)``."""
    hidden = x.shape[-1]
    tokens = x.numel() // hidden
    device = x.device.index
    key = _key(kind, device, norm, tokens, hidden, x.dtype, extra)
    compiled = frontend.cached_plan(key)
    if compiled is None and not is_capturing():  # a call outside a program (tests, benchmarks)
        build = {k: b for k, b, _ in _graphs(device, norm, tokens, hidden, x.dtype, training=kind != "forward")}[key]
        if frontend.supported(key, device, build) is None:
            compiled = frontend.plan(key, device, build)
    return compiled, tokens, hidden


def _required(compiled, kind):
    if compiled is None:
        raise RuntimeError(f"residual_norm cudnn: the {kind} graph is not compiled (cuDNN has no engine for it, "
                           f"or a CUDA-graph capture reached it before the program prepared it)")
    return compiled


def _eps(eps: float) -> torch.Tensor:
    return torch.full((1, 1, 1, 1), float(eps), dtype=torch.float32)


def _norm_bias(norm_bias, weight):
    # cuDNN's LayerNorm node takes a bias; a LayerNorm without one adds zeros.
    return norm_bias if norm_bias is not None else torch.zeros_like(weight)


# Forward / backward -------------------------------------------------------------------------------------


def forward(x, bias, residual, weight, norm_bias, eps, group, write_residual, *, norm):
    """``(y, h)`` of ``h = x [+ bias] [+ residual]``, ``y = norm(h)`` (``h`` empty unless
    ``write_residual``)."""
    h = x
    if bias is not None:
        h = h + bias
    if residual is not None:
        h = h + residual
    h = h.contiguous()
    compiled, _, _ = _plan("forward", h, norm)
    compiled = _required(compiled, "forward")
    y = torch.empty_like(h)
    buffers = {X: h, SCALE: weight.contiguous(), EPS: _eps(eps), Y: y}
    if norm == "layer":
        buffers[BIAS] = _norm_bias(norm_bias, weight).contiguous()
    frontend.execute(compiled, buffers)
    if not write_residual:
        return y, x.new_empty(0)
    return y, (h.clone() if h is x or h is residual else h)


def _statistics(h, weight, norm_bias, eps, norm):
    """``(mean or None, inv_var)`` of ``h``'s rows, float32 ``[tokens, 1]``."""
    hidden = h.shape[-1]
    rows = h.reshape(-1, hidden)
    if norm == "rms":
        inv_var = torch.linalg.vector_norm(rows, dim=1, keepdim=True, dtype=torch.float32)
        return None, inv_var.square_().mul_(1.0 / hidden).add_(eps).rsqrt_()
    compiled, tokens, _ = _plan("stats", h, norm)
    if compiled is None:  # no cuDNN engine for the training forward here: torch's kernel, float32 statistics
        _, mean, rstd = torch.native_layer_norm(rows, [hidden], weight, norm_bias, eps)
        return mean.reshape(tokens, 1).float(), rstd.reshape(tokens, 1).float()
    mean = torch.empty(tokens, 1, dtype=torch.float32, device=h.device)
    inv_var = torch.empty(tokens, 1, dtype=torch.float32, device=h.device)
    scratch = torch.empty_like(h)
    frontend.execute(compiled, {X: h, SCALE: weight, BIAS: _norm_bias(norm_bias, weight), EPS: _eps(eps),
                                Y: scratch, MEAN: mean, INV_VAR: inv_var})
    return mean, inv_var


def backward(dy, h, dh_out, weight, norm_bias, eps, *, norm):
    """``(dh, dweight, dnorm_bias)`` with ``dh = norm_backward(dy, h) + dh_out``."""
    dy, h, weight = dy.contiguous(), h.contiguous(), weight.contiguous()
    mean, inv_var = _statistics(h, weight, norm_bias, eps, norm)
    compiled = None
    if dh_out is not None:  # dx in float32, so dh_out is summed before the one rounding
        compiled, _, _ = _plan("backward", h, norm, (torch.float32,))
    dx_dtype = torch.float32 if compiled is not None else h.dtype
    if compiled is None:
        compiled = _required(_plan("backward", h, norm, (h.dtype,))[0], "backward")
    dx = torch.empty(h.shape, dtype=dx_dtype, device=h.device)
    dw = torch.empty_like(weight)
    buffers = {DY: dy, X: h, SCALE: weight, INV_VAR: inv_var, DX: dx, DSCALE: dw}
    db = dy.new_empty(0)
    if norm == "layer":
        buffers[MEAN] = mean
        db = buffers[DBIAS] = torch.empty_like(weight)
        if norm_bias is None:
            db = dy.new_empty(0)
    frontend.execute(compiled, buffers)
    if dh_out is not None:
        dh_out = dh_out.reshape(dx.shape)
        dx = dx.add_(dh_out) if dx.dtype == torch.float32 else torch.add(dx.float(), dh_out.float())
        dx = dx.to(h.dtype)
    return dx, dw, db
