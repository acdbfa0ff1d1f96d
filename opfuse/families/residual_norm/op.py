"""The residual-norm fused ops: all-reduce (optional) + bias (optional) + residual add (optional) +
RMSNorm / LayerNorm (optional).

=========================  ==============================================  ===========================
fused op (``name``)        computes                                        module
=========================  ==============================================  ===========================
``allreduce_add_rmsnorm``  ``h = sum_ranks(x) [+ b] [+ r]``, ``y = rms(h)``  :class:`AllReduceAddRMSNorm`
``allreduce_add_layernorm``  same with LayerNorm                           :class:`AllReduceAddLayerNorm`
``add_rmsnorm``            ``h = x [+ b] + r``, ``y = rms(h)``             :class:`AddRMSNorm`
``add_layernorm``          same with LayerNorm                             :class:`AddLayerNorm`
``allreduce``              ``y = sum_ranks(x) [+ b] [+ r]``                :class:`FusedAllReduce`
``add_rmsnorm_quantize``   ``add_rmsnorm``, ``y`` emitted in FP8          :class:`AddRMSNormQuantize`
``add_layernorm_quantize``  same with LayerNorm                            :class:`AddLayerNormQuantize`
``allreduce_add_rmsnorm_quantize``  ``allreduce_add_rmsnorm``, ``y`` in FP8  :class:`AllReduceAddRMSNormQuantize`
=========================  ==============================================  ===========================

The ``*_quantize`` ops return ``y`` as an :class:`opfuse.fp8.Float8Activation` (FP8 bytes and
scales; the gradient arriving for it is a plain gradient of ``y``); their backward is the norm's.

Outputs are ``(y, h)``; ``h`` (the new residual, and what backward needs) is written only when it
is used (exported by ``MakeExtraOutput``) or gradients are required, else it is empty.
Backward: ``dh = norm_backward(dy, h) + dh_out`` (summed in float32, rounded once);
``dx = dr = dh`` (an all-reduce's gradient is the identity under tensor-parallel conventions),
``db = sum_tokens(dh)``.
"""

import dataclasses
from typing import Optional, Sequence

import torch
from torch import Tensor

from ...ops import group as groups
from ...ops.base import TensorMeta
from ...ops.norm import compute_dtype
from .implementations import TABLE as implementations
from ...machinery.fused_op import FusedOp, define_fused_op
from ...machinery.implementation import CallSpec

__all__ = ["AllReduceAddRMSNorm", "AllReduceAddLayerNorm", "AddRMSNorm", "AddLayerNorm", "FusedAllReduce",
           "AddRMSNormQuantize", "AddLayerNormQuantize", "AllReduceAddRMSNormQuantize"]


def _forward(x: Tensor, bias: Optional[Tensor], residual: Optional[Tensor], weight: Optional[Tensor],
             norm_bias: Optional[Tensor], eps: float, group: str, write_residual: bool,
             impl: str) -> tuple[Tensor, Tensor]:
    """Prototype: ``(y, h)``."""


def _fake(x, bias, residual, weight, norm_bias, eps, group, write_residual, impl):
    return torch.empty_like(x), (torch.empty_like(x) if write_residual else x.new_empty(0))


def _backward(dy: Tensor, h: Tensor, dh_out: Optional[Tensor], weight: Optional[Tensor],
              norm_bias: Optional[Tensor], eps: float, impl: str) -> tuple[Tensor, Tensor, Tensor]:
    """Prototype: ``(dh, dweight, dnorm_bias)``."""


def _backward_fake(dy, h, dh_out, weight, norm_bias, eps, impl):
    dw = torch.empty_like(weight) if weight is not None else dy.new_empty(0)
    db = torch.empty_like(norm_bias) if norm_bias is not None else dy.new_empty(0)
    return torch.empty_like(dy), dw, db


def _setup_context(ctx, inputs, output):
    x, bias, residual, weight, norm_bias, eps, group, write_residual, impl = inputs
    _, h = output
    ctx.save_for_backward(h, weight, norm_bias)
    ctx.eps, ctx.impl = eps, impl
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.has_residual = residual is not None
    ctx.set_materialize_grads(False)


def _autograd(backward_op, trailing: int = 4):
    """The backward of the family's custom ops: gradients of ``(x, bias, residual, weight,
    norm_bias)``, then ``trailing`` non-tensor arguments."""

    def backward(ctx, dy, dh_out):
        h, weight, norm_bias = ctx.saved_tensors
        if dh_out is not None and dh_out.numel() == 0:
            dh_out = None  # the residual output was not written (an empty placeholder)
        dw = dnb = None
        if backward_op is None:  # no norm: the sum's gradient is dy itself
            dsum = dy if dh_out is None else (dh_out if dy is None else dy + dh_out)
        elif dy is None:
            dsum = dh_out
        else:
            if h.numel() == 0 and dy.numel() != 0:
                raise RuntimeError(
                    "opfuse residual norm backward: the pre-norm sum was not kept; the program was compiled for "
                    "inputs that did not require grad (call the block again with requires_grad inputs)")
            dsum, dw_full, dnb_full = backward_op(dy.contiguous(), h, None if dh_out is None else dh_out.contiguous(),
                                                  weight, norm_bias, ctx.eps, ctx.impl)
            dw = dw_full if weight is not None else None
            dnb = dnb_full if norm_bias is not None else None
        dbias = None
        if ctx.bias_dtype is not None and dsum is not None:
            dbias = dsum.reshape(-1, dsum.shape[-1]).sum(0, dtype=compute_dtype(dsum.dtype)).to(ctx.bias_dtype)
        dres = dsum if ctx.has_residual else None
        return (dsum, dbias, dres, dw, dnb) + (None,) * trailing

    return backward


def _define(name: str, has_norm: bool):
    forward_op, _ = define_fused_op(
        name, lookup=implementations.get, forward=_forward, fake=_fake,
        backward=_backward if has_norm else None, backward_fake=_backward_fake if has_norm else None,
        setup_context=_setup_context, autograd=_autograd)
    return forward_op


def _quantize_forward(x: Tensor, bias: Optional[Tensor], residual: Optional[Tensor], weight: Optional[Tensor],
                      norm_bias: Optional[Tensor], eps: float, write_residual: bool, dtype: str, rowwise: bool,
                      amax_group: str, impl: str) -> tuple[Tensor, Tensor]:
    """Prototype: ``(y as an FP8 activation, h)``."""


def _quantize_fake(x, bias, residual, weight, norm_bias, eps, write_residual, dtype, rowwise, amax_group, impl):
    return torch.empty_like(x), (torch.empty_like(x) if write_residual else x.new_empty(0))


def _quantize_setup(ctx, inputs, output):
    x, bias, residual, weight, norm_bias, eps, _write, _dtype, _rowwise, _group, impl = inputs
    _setup_context(ctx, (x, bias, residual, weight, norm_bias, eps, "", _write, impl), output)


def _allreduce_quantize_forward(x: Tensor, bias: Optional[Tensor], residual: Optional[Tensor],
                                weight: Optional[Tensor], norm_bias: Optional[Tensor], eps: float, group: str,
                                write_residual: bool, dtype: str, rowwise: bool, amax_group: str,
                                impl: str) -> tuple[Tensor, Tensor]:
    """Prototype: ``(y as an FP8 activation, h)``."""


def _allreduce_quantize_fake(x, bias, residual, weight, norm_bias, eps, group, write_residual, dtype, rowwise,
                             amax_group, impl):
    return torch.empty_like(x), (torch.empty_like(x) if write_residual else x.new_empty(0))


def _allreduce_quantize_setup(ctx, inputs, output):
    x, bias, residual, weight, norm_bias, eps, group, _write, _dtype, _rowwise, _amax_group, impl = inputs
    _setup_context(ctx, (x, bias, residual, weight, norm_bias, eps, group, _write, impl), output)


def _define_quantize(name: str, reduces: bool = False):
    """The custom ops of a norm emitting FP8; ``reduces``: after an all-reduce over ``group``."""
    if reduces:
        forward, fake, setup, trailing = (_allreduce_quantize_forward, _allreduce_quantize_fake,
                                          _allreduce_quantize_setup, 7)
    else:
        forward, fake, setup, trailing = _quantize_forward, _quantize_fake, _quantize_setup, 6
    forward_op, _ = define_fused_op(
        name, lookup=implementations.get, forward=forward, fake=fake, backward=_backward,
        backward_fake=_backward_fake, setup_context=setup,
        autograd=lambda backward_op: _autograd(backward_op, trailing=trailing))
    return forward_op


class _ResidualNorm(FusedOp):
    """Common body of the family; subclasses fix the reduction and the norm."""

    reduces: bool = True
    norm: str = "rms"
    reference_is_unfused = True  # torch.distributed all-reduce, add, norm: what the model wrote

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
        self.group_name = None  # set by call_spec, when the program chooses the implementation

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

    def call_spec(self, metas: Sequence[TensorMeta]) -> CallSpec:
        x = metas[0]
        residual = metas[1] if self.has_residual else None
        params = [p for p in (self.bias, self.weight, self.norm_bias) if p is not None]
        requires_grad = torch.is_grad_enabled() and (
            any(m.requires_grad for m in metas if m is not None) or any(p.requires_grad for p in params))
        self.write_residual = self.norm != "none" and (self.export_residual or requires_grad)
        # The program is compiled for this group (a re-created default group recompiles it).
        self.group_name = groups.group_name(self.group) if self.reduces else ""
        meta = lambda t: None if t is None else TensorMeta.of(t)  # noqa: E731
        return CallSpec(
            op=self.name,
            inputs={"x": x, "residual": residual, "bias": meta(self.bias), "weight": meta(self.weight),
                    "norm_bias": meta(self.norm_bias)},
            attrs={"norm": self.norm, "eps": self.eps, "write_residual": self.write_residual},
            group_name=groups.group_name(self.group) if self.reduces else None,
            world_size=groups.world_size(self.group) if self.reduces else 1,
            requires_grad=requires_grad,
        )

    def _group_arg(self) -> str:
        """The ``group`` argument of the custom op ("" when the op does not reduce)."""
        if self.group_name is None:  # called outside a program
            return groups.group_name(self.group) if self.reduces else ""
        return self.group_name

    def forward(self, x, residual=None):
        return self.custom_op(x, self.bias, residual, self.weight, self.norm_bias, self.eps, self._group_arg(),
                              self.write_residual, self._impl())


class AllReduceAddRMSNorm(_ResidualNorm):
    """``y = rmsnorm(allreduce(x) [+ bias] [+ residual])``; also returns the new residual."""

    name = "allreduce_add_rmsnorm"
    custom_op = _define(name, True)


class AllReduceAddLayerNorm(_ResidualNorm):
    """``y = layernorm(allreduce(x) [+ bias] [+ residual])``; also returns the new residual."""

    name = "allreduce_add_layernorm"
    norm = "layer"
    custom_op = _define(name, True)


class AddRMSNorm(_ResidualNorm):
    """``y = rmsnorm(x [+ bias] + residual)`` on one device; also returns the new residual."""

    name = "add_rmsnorm"
    reduces = False
    inductor_fuses_alike = True  # Inductor's own add + norm kernel is as good (FusedOp)
    custom_op = _define(name, True)


class AddLayerNorm(_ResidualNorm):
    """``y = layernorm(x [+ bias] + residual)`` on one device; also returns the new residual."""

    name = "add_layernorm"
    reduces = False
    inductor_fuses_alike = True  # Inductor's own add + norm kernel is as good (FusedOp)
    norm = "layer"
    custom_op = _define(name, True)


class _NormQuantize(_ResidualNorm):
    """A residual norm whose output ``y`` is quantized to FP8 (``dtype`` ``"e4m3"`` / ``"e5m2"``,
    per row or per tensor; ``amax_group``: ranks that share one scale)."""

    reduces = False
    reference_is_unfused = False  # its FP8 payload feeds the FP8 GEMMs after it: no aten form to go back to

    def __init__(self, *, dtype: str = "e4m3", rowwise: bool = False, amax_group=None, **kwargs):
        super().__init__(**kwargs)
        self.dtype, self.rowwise, self.amax_group = dtype, rowwise, amax_group

    def extra_repr(self) -> str:
        text = super().extra_repr()
        fp8 = f"to {self.dtype} per {'row' if self.rowwise else 'tensor'}"
        if self.amax_group is not None:
            fp8 += f", amax over group={groups.group_name(self.amax_group)}"
        return f"{text}, {fp8}" if text else fp8

    def call_spec(self, metas: Sequence[TensorMeta]) -> CallSpec:
        spec = super().call_spec(metas)
        # The amax group is an attribute, not the op's group: no peer memory is opened for it.
        attrs = dict(spec.attrs, dtype=self.dtype, rowwise=self.rowwise,
                     amax_group=groups.group_name(self.amax_group) if self.amax_group is not None else None)
        return dataclasses.replace(spec, attrs=attrs)

    def forward(self, x, residual=None):
        amax_group = groups.group_name(self.amax_group) if self.amax_group is not None else ""
        reduce = (self._group_arg(),) if self.reduces else ()
        return self.custom_op(x, self.bias, residual, self.weight, self.norm_bias, self.eps, *reduce,
                              self.write_residual, self.dtype, self.rowwise, amax_group, self._impl())


class AddRMSNormQuantize(_NormQuantize):
    """``y = quantize(rmsnorm(x [+ bias] + residual))`` on one device; also returns the new residual."""

    name = "add_rmsnorm_quantize"
    custom_op = _define_quantize(name)


class AddLayerNormQuantize(_NormQuantize):
    """``y = quantize(layernorm(x [+ bias] + residual))`` on one device; also returns the new residual."""

    name = "add_layernorm_quantize"
    norm = "layer"
    custom_op = _define_quantize(name)


class AllReduceAddRMSNormQuantize(_NormQuantize):
    """``y = quantize(rmsnorm(allreduce(x) [+ bias] [+ residual]))``; also returns the new residual.
    Peer-memory kernels with the quantization in the row finish when capable."""

    name = "allreduce_add_rmsnorm_quantize"
    reduces = True
    custom_op = _define_quantize(name, reduces=True)


class FusedAllReduce(_ResidualNorm):
    """``y = allreduce(x) [+ bias] [+ residual]`` through the peer-memory kernels when capable (the
    kernels' epilogue without a norm: a block's last residual add fuses with its all-reduce)."""

    name = "allreduce"
    norm = "none"
    custom_op = _define(name, False)

    def __init__(self, *, group=None, bias=None, has_residual: bool = False):
        super().__init__(group=group, bias=bias, has_residual=has_residual)
