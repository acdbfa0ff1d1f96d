"""``grouped_linear`` through cuDNN's MoE grouped matmul (``moe_grouped_matmul`` node of the cuDNN
frontend, ``pip install opfuse[cudnn]``), with device-side group offsets.

cuDNN reads ``first_token_offset [G + 1, 1, 1]`` (int32 row boundaries, built on the device from
``group_sizes`` with no host sync) and multiplies each group's rows of ``token [1, T, K]`` with its
expert's ``weight [G, K, N]`` (opfuse's ``[G, N, K]`` weight read transposed, no copy). Rows past
the last boundary are unspecified in cuDNN's contract, so they are zeroed afterwards (the
family's Triton tail kernel).

Backward: ``dx`` is the same node on the weight read untransposed (``[G, N, K]`` as ``[E, N, K]``);
``dw`` is cuDNN's ``moe_grouped_matmul_bwd`` node (cuDNN >= 9.22 to validate). A piece cuDNN has no
engine for here runs through the ``triton`` implementation's backward instead, which the check
requires then (and says so). No bias (the node has no bias input).

Every node is checked with several non-empty groups by tests/gpu/test_nvidia_libs.py: with cuDNN
9.18-9.20 the FP8 variant was reported to compute only the first group.
"""

from __future__ import annotations

import torch

from ...runtime import cudnn_frontend as frontend
from ...runtime.device import is_capturing
from . import torch_mm, triton_impl

__all__ = ["NAME", "check", "prepare", "forward", "backward", "first_token_offsets"]

NAME = "cudnn"
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
TOKEN, WEIGHT, OFFSETS, OUT, DOUT, DWEIGHT = 1, 2, 3, 10, 20, 21


def first_token_offsets(group_sizes: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[0, end_0, ..., end_{G-1}]`` as int32 ``[G + 1, 1, 1]`` on the device (ends clamped to
    ``[0, tokens]`` and monotone, like the other implementations)."""
    ends = torch_mm.device_offsets(group_sizes, tokens)
    return torch.cat([ends.new_zeros(1), ends]).view(-1, 1, 1)


def build_matmul(cudnn, h, *, tokens, groups, k, n, dtype, weight_nk: bool):
    """``out[rows of g] = token[rows of g] @ W_g`` with ``W_g`` ``[K, N]``; ``weight_nk``: the weight
    buffer is ``[G, N, K]`` row-major (opfuse's layout: forward), else ``[G, K, N]`` row-major
    (the backward's ``dx = dy @ W_g`` reads opfuse's ``[G, N, K]`` weight as ``[G, K', N']``)."""
    io = frontend.data_type(dtype)
    g = cudnn.pygraph(handle=h, intermediate_data_type=io, compute_data_type=cudnn.data_type.FLOAT)
    token = g.tensor(name="token", dim=[1, tokens, k], stride=[tokens * k, k, 1], data_type=io, uid=TOKEN)
    stride = [n * k, 1, k] if weight_nk else [k * n, n, 1]
    weight = g.tensor(name="weight", dim=[groups, k, n], stride=stride, data_type=io, uid=WEIGHT)
    offsets = g.tensor(name="first_token_offset", dim=[groups + 1, 1, 1], stride=[1, 1, 1],
                       data_type=cudnn.data_type.INT32, uid=OFFSETS)
    out = g.moe_grouped_matmul(token=token, weight=weight, first_token_offset=offsets, token_index=None,
                               token_ks=None, mode=cudnn.moe_grouped_matmul_mode.NONE, top_k=1,
                               compute_data_type=cudnn.data_type.FLOAT, name="moe")
    out.set_uid(OUT).set_output(True).set_data_type(io).set_dim([1, tokens, n]).set_stride([tokens * n, n, 1])
    return g


def build_wgrad(cudnn, h, *, tokens, groups, k, n, dtype):
    """``dweight[g] = dout[rows of g].T-contracted with token[rows of g]`` as cuDNN's
    ``moe_grouped_matmul_bwd``: ``[E, K, N]`` from ``token [1, T, K]`` and ``doutput [1, T, N]``;
    written into opfuse's ``[G, N, K]`` buffer through the strides ``[N*K, 1, K]``."""
    io = frontend.data_type(dtype)
    g = cudnn.pygraph(handle=h, intermediate_data_type=io, compute_data_type=cudnn.data_type.FLOAT)
    dout = g.tensor(name="doutput", dim=[1, tokens, n], stride=[tokens * n, n, 1], data_type=io, uid=DOUT)
    token = g.tensor(name="token", dim=[1, tokens, k], stride=[tokens * k, k, 1], data_type=io, uid=TOKEN)
    offsets = g.tensor(name="first_token_offset", dim=[groups + 1, 1, 1], stride=[1, 1, 1],
                       data_type=cudnn.data_type.INT32, uid=OFFSETS)
    dweight = g.moe_grouped_matmul_bwd(doutput=dout, token=token, first_token_offset=offsets,
                                       compute_data_type=cudnn.data_type.FLOAT, name="moe_wgrad")
    dweight.set_uid(DWEIGHT).set_output(True).set_data_type(io).set_dim([groups, k, n]).set_stride([n * k, 1, k])
    return g


def _graphs(device, tokens, groups, k, n, dtype, training):
    """``{piece: (key, builder)}``: ``forward``, and for training ``dgrad`` and ``wgrad``."""
    base = ("grouped_linear", device, tokens, groups, k, n, dtype)

    def matmul(kk, nn, weight_nk):
        return lambda cudnn, h: build_matmul(cudnn, h, tokens=tokens, groups=groups, k=kk, n=nn, dtype=dtype,
                                             weight_nk=weight_nk)

    graphs = {"forward": (base + ("forward",), matmul(k, n, True))}
    if training:
        graphs["dgrad"] = (base + ("dgrad",), matmul(n, k, False))
        graphs["wgrad"] = (base + ("wgrad",), lambda cudnn, h: build_wgrad(cudnn, h, tokens=tokens, groups=groups,
                                                                           k=k, n=n, dtype=dtype))
    return graphs


def _spec_graphs(spec):
    groups, n, k = spec.inputs["weight"].shape
    device = spec.device.index if spec.device.index is not None else torch.cuda.current_device()
    return device, _graphs(device, spec.x.tokens, groups, k, n, spec.dtype, spec.requires_grad)


def check(spec) -> str | None:
    """Capable on CUDA for bfloat16/float16 without bias when cuDNN has an engine for the forward
    node here; for training, pieces cuDNN cannot run go to the Triton kernels (which must then be
    available)."""
    if spec.inputs.get("bias") is not None:
        return "cuDNN's MoE grouped matmul has no bias input"
    reason = frontend.spec_reason(spec, SUPPORTED_DTYPES, ("weight",))
    if reason:
        return reason
    reason = triton_impl.triton_status()
    if reason:
        return f"needs triton for its tail-row fix-up: {reason}"
    device, graphs = _spec_graphs(spec)
    if is_capturing() and any(frontend.cached_plan(key) is None for key, _ in graphs.values()):
        return "cuDNN graphs cannot be built during CUDA-graph capture"
    key, build = graphs["forward"]
    reason = frontend.supported(key, device, build)
    if reason:
        return f"forward: {reason}"
    for piece in ("dgrad", "wgrad"):
        if piece not in graphs:
            continue
        key, build = graphs[piece]
        if frontend.supported(key, device, build):
            fallback = triton_impl.check(spec)
            if fallback:
                return f"cuDNN has no {piece} engine here and the Triton fallback cannot run: {fallback}"
    return None


def prepare(spec) -> None:
    """Compile the graphs cuDNN supports (the others run on the Triton kernels)."""
    device, graphs = _spec_graphs(spec)
    for key, build in graphs.values():
        if frontend.supported(key, device, build) is None:
            frontend.plan(key, device, build)


def _compiled(piece, x, groups, k, n, training):
    device = x.device.index
    key, build = _graphs(device, x.shape[0], groups, k, n, x.dtype, training)[piece]
    compiled = frontend.cached_plan(key)
    if compiled is None and frontend.supported(key, device, build) is None:
        compiled = frontend.plan(key, device, build)  # a call outside a program: build on first use
    return compiled


def forward(x, group_sizes, weight, bias):
    """``y [T, N]``; rows past ``sum(group_sizes)`` are zero."""
    tokens = x.shape[0]
    groups, n, k = weight.shape
    if tokens == 0:
        return x.new_zeros(0, n)
    compiled = _compiled("forward", x, groups, k, n, training=False)
    if compiled is None:
        raise RuntimeError(f"grouped_linear cudnn: no forward engine for {tokens}x{k} -> {n}, {groups} groups")
    y = x.new_empty(tokens, n)
    frontend.execute(compiled, {TOKEN: x.contiguous(), WEIGHT: weight.contiguous(),
                                OFFSETS: first_token_offsets(group_sizes, tokens), OUT: y})
    torch_mm.zero_tail_rows(y, group_sizes)
    return y


def backward(dy, x, group_sizes, weight, *, need_dx, need_dw, need_db):
    """``(dx, dw, db)``: cuDNN where it has engines, the Triton kernels for the rest."""
    empty = dy.new_empty(0)
    tokens = dy.shape[0]
    groups, n, k = weight.shape
    if need_db:
        raise RuntimeError("grouped_linear cudnn: no bias support (the capability check rejects a bias)")
    if tokens == 0:
        return (torch.zeros_like(x) if need_dx else empty, dy.new_zeros(weight.shape) if need_dw else empty, empty)
    dy = dy.contiguous()
    offsets = first_token_offsets(group_sizes, tokens)
    dx = dw = empty
    dgrad = _compiled("dgrad", dy, groups, k, n, training=True) if need_dx else None
    wgrad = _compiled("wgrad", dy, groups, k, n, training=True) if need_dw else None
    if dgrad is not None:
        dx = x.new_empty(tokens, k)
        frontend.execute(dgrad, {TOKEN: dy, WEIGHT: weight.contiguous(), OFFSETS: offsets, OUT: dx})
        torch_mm.zero_tail_rows(dx, group_sizes)
    if wgrad is not None:
        dw = dy.new_empty(weight.shape)
        frontend.execute(wgrad, {DOUT: dy, TOKEN: x.contiguous(), OFFSETS: offsets, DWEIGHT: dw})
        torch_mm.zero_empty_groups(dw, group_sizes, tokens)
    rest_dx, rest_dw = need_dx and dgrad is None, need_dw and wgrad is None
    if rest_dx or rest_dw:
        fdx, fdw, _ = triton_impl.backward(dy, x, group_sizes, weight, need_dx=rest_dx, need_dw=rest_dw,
                                           need_db=False)
        dx = fdx if rest_dx else dx
        dw = fdw if rest_dw else dw
    return dx, dw, empty
