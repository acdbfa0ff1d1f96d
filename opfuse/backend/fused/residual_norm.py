"""All-reduce (optional) + bias (optional) + residual add (optional) + RMSNorm/LayerNorm (optional).

One ``torch.library`` custom op, ``opfuse::residual_norm``, covers the family:

=========================  ======================================  ========================
fused module               computes                                dispatch op
=========================  ======================================  ========================
``AllReduceAddRMSNorm``    ``h = sum_ranks(x) [+ b] [+ r]``,       ``allreduce_add_norm``
                           ``y = rmsnorm(h)``
``AllReduceAddLayerNorm``  same with LayerNorm                     ``allreduce_add_norm``
``AddRMSNorm``             ``h = x [+ b] + r``, ``y = rmsnorm(h)`` ``add_norm``
``AddLayerNorm``           same with LayerNorm                     ``add_norm``
``FusedAllReduce``         ``y = sum_ranks(x) [+ b]``              ``allreduce``
=========================  ======================================  ========================

Outputs are ``(y, h)``; ``h`` (the new residual, and what backward needs) is written only when
it is used (exported by ``MakeExtraOutput``) or gradients are required, else it is empty.
Backward: ``dh = norm_backward(dy, h) + dh_out``; ``dx = dr = dh`` (an all-reduce's gradient is
the identity under tensor-parallel conventions), ``db = sum_tokens(dh)``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from ...ops import group as groups
from ...ops.base import TensorMeta
from ...ops.collectives import raw_all_reduce
from ...ops.norm import compute_dtype, layer_norm_reference, rms_norm_reference
from .. import dispatch
from .base import FusedCall, FusedOp

__all__ = [
    "AllReduceAddRMSNorm",
    "AllReduceAddLayerNorm",
    "AddRMSNorm",
    "AddLayerNorm",
    "FusedAllReduce",
    "reference_forward",
    "reference_backward",
    "NORMS",
]

NORMS = ("rms", "layer", "none")


# Reference implementation ----------------------------------------------------------------


def apply_norm(h: Tensor, weight: Optional[Tensor], norm_bias: Optional[Tensor], norm: str, eps: float) -> Tensor:
    if norm == "rms":
        return rms_norm_reference(h, weight, eps)
    if norm == "layer":
        return layer_norm_reference(h, weight, norm_bias, eps)
    raise ValueError(f"residual_norm: norm={norm!r}; accepted: {NORMS}")


def reference_forward(x, bias, residual, weight, norm_bias, *, norm, eps, group, write_residual):
    """Torch ops and ``torch.distributed``: exactly the unfused chain of basic ops."""
    h = raw_all_reduce(x, groups.from_name(group)) if group else x
    if bias is not None:
        h = h + bias
    if residual is not None:
        h = h + residual
    if norm == "none":
        return (h.clone() if h is x else h), x.new_empty(0)
    y = apply_norm(h, weight, norm_bias, norm, eps)
    if not write_residual:
        return y, x.new_empty(0)
    return y, (h.clone() if h is x or h is residual else h)


def reference_backward(dy, h, weight, norm_bias, *, norm, eps):
    """Gradient of ``y = norm(h)`` in float32 (closed form; custom ops run without autograd)."""
    ct = compute_dtype(h.dtype)
    hf = h.to(ct).reshape(-1, h.shape[-1])
    dyf = dy.to(ct).reshape(-1, h.shape[-1])
    g = dyf * weight.to(ct) if weight is not None else dyf
    if norm == "rms":
        rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        xhat = hf * rstd
        dh = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    elif norm == "layer":
        mean = hf.mean(-1, keepdim=True)
        rstd = torch.rsqrt((hf - mean).pow(2).mean(-1, keepdim=True) + eps)
        xhat = (hf - mean) * rstd
        dh = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    else:
        raise ValueError(f"residual_norm backward: norm={norm!r}; accepted: 'rms', 'layer'")
    dw = (dyf * xhat).sum(0).to(weight.dtype) if weight is not None else dy.new_empty(0)
    db = dyf.sum(0).to(norm_bias.dtype) if norm_bias is not None else dy.new_empty(0)
    return dh.to(h.dtype).reshape(h.shape), dw, db


# Custom ops --------------------------------------------------------------------------------


def _residual_norm(x: Tensor, bias: Optional[Tensor], residual: Optional[Tensor], weight: Optional[Tensor],
                   norm_bias: Optional[Tensor], norm: str, eps: float, group: str, op: str, impl: str,
                   write_residual: bool) -> tuple[Tensor, Tensor]:
    return dispatch.get(op, impl).forward(x, bias, residual, weight, norm_bias, norm=norm, eps=eps, group=group,
                                          write_residual=write_residual)


def _residual_norm_fake(x, bias, residual, weight, norm_bias, norm, eps, group, op, impl, write_residual):
    keep_h = write_residual and norm != "none"
    return torch.empty_like(x), (torch.empty_like(x) if keep_h else x.new_empty(0))


def _residual_norm_backward(dy: Tensor, h: Tensor, weight: Optional[Tensor], norm_bias: Optional[Tensor],
                            norm: str, eps: float, op: str, impl: str) -> tuple[Tensor, Tensor, Tensor]:
    chosen = dispatch.get(op, impl)
    backward = chosen.backward or reference_backward
    return backward(dy, h, weight, norm_bias, norm=norm, eps=eps)


def _residual_norm_backward_fake(dy, h, weight, norm_bias, norm, eps, op, impl):
    dw = torch.empty_like(weight) if weight is not None else dy.new_empty(0)
    db = torch.empty_like(norm_bias) if norm_bias is not None else dy.new_empty(0)
    return torch.empty_like(dy), dw, db


RESIDUAL_NORM_BACKWARD = FusedCall("opfuse::residual_norm_backward", _residual_norm_backward,
                                   _residual_norm_backward_fake)


def _setup_context(ctx, inputs, output):
    x, bias, residual, weight, norm_bias, norm, eps, group, op, impl, write_residual = inputs
    _, h = output
    ctx.save_for_backward(h, weight, norm_bias)
    ctx.norm, ctx.eps, ctx.op, ctx.impl = norm, eps, op, impl
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.has_residual = residual is not None
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dh_out):
    h, weight, norm_bias = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(h) if h.numel() else None
    dw = dnb = None
    if ctx.norm == "none":
        dsum = dy
    else:
        if h.numel() == 0:
            raise RuntimeError(
                "opfuse residual_norm backward: the pre-norm sum was not kept; the program was compiled "
                "for inputs that did not require grad (call the block again with requires_grad inputs)"
            )
        dsum, dw_full, dnb_full = RESIDUAL_NORM_BACKWARD(dy.contiguous(), h, weight, norm_bias, ctx.norm, ctx.eps,
                                                         ctx.op, ctx.impl)
        dw = dw_full if weight is not None else None
        dnb = dnb_full if norm_bias is not None else None
    if dh_out is not None:
        dsum = dh_out if dsum is None else dsum + dh_out
    dbias = None
    if ctx.bias_dtype is not None and dsum is not None:
        dbias = dsum.reshape(-1, dsum.shape[-1]).sum(0, dtype=compute_dtype(dsum.dtype)).to(ctx.bias_dtype)
    dres = dsum if ctx.has_residual else None
    return dsum, dbias, dres, dw, dnb, None, None, None, None, None, None


RESIDUAL_NORM = FusedCall("opfuse::residual_norm", _residual_norm, _residual_norm_fake, _setup_context, _backward)


# Fused modules -------------------------------------------------------------------------------


class _ResidualNorm(FusedOp):
    """Common body of the family; subclasses fix the reduction and the norm."""

    reduces: bool = True
    norm: str = "rms"

    def __init__(self, *, group=None, bias=None, weight=None, norm_bias=None, eps: float = 1e-6,
                 has_residual: bool = True, export_residual: bool = False):
        super().__init__()
        self.group = group
        self.bias = bias
        self.weight = weight
        self.norm_bias = norm_bias
        self.eps = float(eps)
        self.has_residual = has_residual
        self.export_residual = export_residual
        self.write_residual = export_residual

    @property
    def op_name(self) -> str:  # type: ignore[override]
        if self.reduces:
            return "allreduce" if self.norm == "none" else "allreduce_add_norm"
        return "add_norm"

    def extra_repr(self) -> str:
        parts = []
        if self.reduces:
            parts.append(f"group={groups.group_name(self.group)}")
        if self.bias is not None:
            parts.append("bias")
        if self.has_residual:
            parts.append("residual")
        if self.norm != "none":
            parts.append(f"eps={self.eps:g}")
        if self.impl:
            parts.append(f"impl={self.impl}")
        return ", ".join(parts)

    def call_spec(self, metas: Sequence[TensorMeta]) -> dispatch.CallSpec:
        x = metas[0]
        residual = metas[1] if self.has_residual else None
        params = [p for p in (self.bias, self.weight, self.norm_bias) if p is not None]
        requires_grad = torch.is_grad_enabled() and (
            any(m.requires_grad for m in metas if m is not None) or any(p.requires_grad for p in params))
        self.write_residual = self.export_residual or (requires_grad and self.norm != "none")
        meta = lambda t: None if t is None else TensorMeta.of(t)  # noqa: E731
        return dispatch.CallSpec(
            op=self.op_name,
            inputs={"x": x, "residual": residual, "bias": meta(self.bias), "weight": meta(self.weight),
                    "norm_bias": meta(self.norm_bias)},
            attrs={"norm": self.norm, "eps": self.eps, "write_residual": self.write_residual},
            group_name=groups.group_name(self.group) if self.reduces else None,
            world_size=groups.world_size(self.group) if self.reduces else 1,
            requires_grad=requires_grad,
        )

    def forward(self, x, residual=None):
        group = groups.group_name(self.group) if self.reduces else ""
        return RESIDUAL_NORM(x, self.bias, residual, self.weight, self.norm_bias, self.norm, self.eps, group,
                             self.op_name, self._impl(), self.write_residual)


class AllReduceAddRMSNorm(_ResidualNorm):
    """``y = rmsnorm(allreduce(x) [+ bias] [+ residual])``; also returns the new residual."""


class AllReduceAddLayerNorm(_ResidualNorm):
    """``y = layernorm(allreduce(x) [+ bias] [+ residual])``; also returns the new residual."""

    norm = "layer"


class AddRMSNorm(_ResidualNorm):
    """``y = rmsnorm(x [+ bias] + residual)`` on one device; also returns the new residual."""

    reduces = False


class AddLayerNorm(_ResidualNorm):
    """``y = layernorm(x [+ bias] + residual)`` on one device; also returns the new residual."""

    reduces = False
    norm = "layer"


class FusedAllReduce(_ResidualNorm):
    """``y = allreduce(x) [+ bias]`` through the peer-memory kernels when capable."""

    norm = "none"

    def __init__(self, *, group=None, bias=None):
        super().__init__(group=group, bias=bias, has_residual=False)
