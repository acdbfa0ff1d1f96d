"""The residual-norm family's recognizers: RMSNorm and LayerNorm in aten graphs, in the forms
Inductor's decompositions and hand-written models leave them (see :mod:`opfuse.machinery.region`
for what a region is, :mod:`opfuse.machinery.recognizer` for how recognizers run):

=================  ==========================================================================
op                 aten form
=================  ==========================================================================
``RMSNorm``        ``x.float() -> pow(2) (or x*x) -> mean(-1, keepdim) -> + eps -> rsqrt -> x*rstd``,
                   then ``* weight`` and the cast back in either order (F.rms_norm, nn.RMSNorm,
                   Llama-style hand-written norms); ``x.float()`` is absent for float32 inputs
``LayerNorm``      ``var_mean(x.float(), -1, correction=0) -> + eps -> rsqrt -> (x - mean) * rstd``,
                   ``* weight``, ``+ bias``, cast back (F.layer_norm, nn.LayerNorm)
=================  ==========================================================================
"""

from __future__ import annotations

import torch
from torch import fx

from ...machinery.aten import aten, before_upcast, calls, dtype, is_cast_to, is_static_size, same_shape, scalar, shape
from ...machinery.recognizer import Found, Phase, Recognizer
from ...machinery.region import ParamSource, Region, frozen, is_input, is_vector_of, other
from ...ops.norm import LayerNorm, RMSNorm

__all__ = ["rms_norm", "layer_norm", "RECOGNIZERS"]


# Norms ----------------------------------------------------------------------------------------------


def _is_last_dim(dims, ndim: int, keepdim) -> bool:
    return keepdim is True and list(dims) in ([-1], [ndim - 1])


def _param_operand(user: fx.Node, cur: fx.Node, hidden: int) -> tuple[fx.Node | None, fx.Node | None]:
    """The parameter ``user`` multiplies ``cur`` by: a graph input of shape ``[hidden]``, or a
    half-precision one cast to float32 (``normed * weight.float()``, the weight applied before the
    cast back). Returns ``(parameter, cast or None)``. The cast belongs to the region only when the
    multiply is its one user (a joint graph's backward may read it too: then it stays)."""
    operand = other(user, cur)
    if operand is None or not is_vector_of(operand, hidden):
        return None, None
    if is_input(operand):
        return operand, None
    if (is_cast_to(operand, torch.float32) and is_input(operand.args[0])
            and dtype(operand.args[0]) in (torch.bfloat16, torch.float16)):
        return operand.args[0], (operand if len(operand.users) == 1 else None)
    return None, None


def _affine_tail(start: fx.Node, x: fx.Node, hidden: int, with_bias: bool):
    """Follow ``start`` through ``* weight``, ``+ bias`` (LayerNorm) and the cast back to ``x``'s
    dtype, in any order Inductor's decompositions or hand-written norms produce. Returns
    ``(last node, nodes, weight, bias)``."""
    cur, nodes, weight, bias = start, [], None, None
    while True:
        step = None
        for user in cur.users:
            if is_cast_to(user) and user.args[0] is cur and dtype(user) == dtype(x) and dtype(cur) != dtype(x):
                step = ("cast", user, None)
            elif calls(user, aten.mul.Tensor) and weight is None and bias is None:
                operand, cast = _param_operand(user, cur, hidden)
                if operand is not None:
                    step = ("weight", user, operand)
                    if cast is not None:
                        nodes.append(cast)
            elif (calls(user, aten.add.Tensor) and with_bias and bias is None and len(user.args) == 2
                  and not user.kwargs):
                operand, cast = _param_operand(user, cur, hidden)
                if operand is not None:
                    step = ("bias", user, operand)
                    if cast is not None:
                        nodes.append(cast)
            if step is not None:
                break
        if step is None:
            return cur, nodes, weight, bias
        kind, cur, operand = step
        nodes.append(cur)
        if kind == "weight":
            weight = operand
        elif kind == "bias":
            bias = operand


def _norm_region(cls, x, xf, normed, out, nodes, weight, bias, eps) -> Region | None:
    hidden = shape(x)[-1]
    if not is_static_size(hidden) or not same_shape(shape(out), shape(x)):
        return None  # feature sizes are fixed (only token counts may vary between calls)
    param_dtype = dtype(weight) if weight is not None else dtype(x)
    if bias is not None and weight is not None and dtype(bias) != dtype(weight):
        return None
    # The fused op returns x's dtype. A different result dtype is only acceptable when a
    # parameter of another dtype caused it: the rules' norm_params_match_input refuses those
    # (and says so in explain()).
    if dtype(out) != dtype(x) and param_dtype == dtype(x):
        return None
    if cls is RMSNorm:
        op = RMSNorm(hidden, eps=eps, elementwise_affine=weight is not None, device="meta", dtype=param_dtype)
    else:
        if bias is not None and weight is None:
            return None
        op = LayerNorm(hidden, eps=eps, elementwise_affine=weight is not None, bias=bias is not None, device="meta",
                       dtype=param_dtype)
    params = {}
    if weight is not None:
        params[op.weight] = ParamSource(weight)
    if bias is not None:
        params[op.bias] = ParamSource(bias)
    if xf is not x:
        nodes.add(xf)
    return Region(frozen(op), (x,), out, frozenset(nodes), params)


def rms_norm(rsqrt: fx.Node, found: Found | None = None) -> Region | None:
    if not calls(rsqrt, aten.rsqrt.default):
        return None
    add = rsqrt.args[0]
    if not calls(add, aten.add.Tensor, aten.add.Scalar) or scalar(add.args[1]) is None:
        return None
    mean = add.args[0]
    if not calls(mean, aten.mean.dim) or len(mean.args) < 3:
        return None
    square = mean.args[0]
    if calls(square, aten.pow.Tensor_Scalar) and scalar(square.args[1]) == 2.0:
        xf = square.args[0]
    elif calls(square, aten.mul.Tensor) and square.args[0] is square.args[1]:
        xf = square.args[0]
    else:
        return None
    if shape(xf) is None or not _is_last_dim(mean.args[1], len(shape(xf)), mean.args[2]):
        return None
    normed = next((u for u in rsqrt.users if calls(u, aten.mul.Tensor) and other(u, rsqrt) is xf), None)
    if normed is None:
        return None
    x = before_upcast(xf)
    out, tail, weight, _ = _affine_tail(normed, x, shape(x)[-1], with_bias=False)
    nodes = {square, mean, add, rsqrt, normed, *tail}
    return _norm_region(RMSNorm, x, xf, normed, out, nodes, weight, None, scalar(add.args[1]))


def layer_norm(var_mean: fx.Node, found: Found | None = None) -> Region | None:
    if not calls(var_mean, aten.var_mean.correction) or var_mean.kwargs.get("correction", 1) != 0:
        return None
    if var_mean.kwargs.get("keepdim") is not True or len(var_mean.args) < 2:
        return None
    xf = var_mean.args[0]
    if shape(xf) is None or list(var_mean.args[1]) not in ([-1], [len(shape(xf)) - 1]):
        return None
    items = {u.args[1]: u for u in var_mean.users if u.op == "call_function" and len(u.args) == 2}
    var, mean = items.get(0), items.get(1)
    if var is None or mean is None:
        return None
    add = next((u for u in var.users if calls(u, aten.add.Tensor, aten.add.Scalar) and scalar(u.args[1]) is not None),
               None)
    rsqrt = next(iter(add.users), None) if add is not None and len(add.users) == 1 else None
    if not calls(rsqrt, aten.rsqrt.default):
        return None
    centered = next((u for u in mean.users if calls(u, aten.sub.Tensor) and u.args[0] is xf and u.args[1] is mean),
                    None)
    if centered is None:
        return None
    normed = next((u for u in centered.users if calls(u, aten.mul.Tensor) and other(u, centered) is rsqrt), None)
    if normed is None:
        return None
    x = before_upcast(xf)
    out, tail, weight, bias = _affine_tail(normed, x, shape(x)[-1], with_bias=True)
    nodes = {var_mean, var, mean, add, rsqrt, centered, normed, *tail}
    return _norm_region(LayerNorm, x, xf, normed, out, nodes, weight, bias, scalar(add.args[1]))


RECOGNIZERS = (
    Recognizer("rms_norm", Phase.NORMS_AND_ACTIVATIONS, rms_norm,
               "RMSNorm: x.float() -> pow(2) or x*x -> mean(-1) -> + eps -> rsqrt -> * x, weight and cast back"),
    Recognizer("layer_norm", Phase.NORMS_AND_ACTIVATIONS, layer_norm,
               "LayerNorm: var_mean(x.float(), -1) -> + eps -> rsqrt -> (x - mean) * rstd, weight, bias, cast back"),
)
