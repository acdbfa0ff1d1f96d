"""``Float8Activation``: an activation quantized to FP8 that autograd still sees as a tensor of the
activation dtype.

A block's graph passes quantized activations between ops (a norm that emits FP8, an all-gather of
FP8 bytes, the GEMM that consumes them). Autograd must keep seeing the high-precision value: the
gradient of an FP8 activation is a gradient of the activation, in its dtype (an FP8 gradient
would be rounded to the activation's format). ``Float8Activation`` is a wrapper tensor subclass
with the activation's shape and dtype that holds ``_data`` (FP8, same shape) and ``_scale_inv``
(float32 ``[1, 1]`` or ``[rows, 1]``, :mod:`.numerics`). Ops that know it read the payload; any
other torch op sees its dequantized value (``__torch_dispatch__``), which is exactly what the
quantized activation stands for.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from .numerics import Quantized, dequantize, quantize

__all__ = ["Float8Activation", "quantize_activation", "payload", "tag"]

_aten = torch.ops.aten
# Ops that return the tensor itself (autograd wraps Function outputs and saved tensors in them).
_SAME_VALUE = {_aten.detach.default, _aten.alias.default, _aten.view.default, _aten._unsafe_view.default}


def tag(dtype: torch.dtype, rowwise: bool) -> str:
    """``"e4m3/tensor"``, ``"e5m2/row"``, ...: an FP8 value's format and what one scale covers
    (``TensorMeta.quantized``)."""
    short = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}.get(dtype, str(dtype))
    return f"{short}/{'row' if rowwise else 'tensor'}"


class Float8Activation(torch.Tensor):
    """An FP8 activation: shape and dtype of the high-precision tensor, payload in FP8.

    Build one with :func:`quantize_activation`. ``.dequantize()`` returns the represented value.
    """

    #: Fused ops call their eager path (not the custom-op dispatcher) for this subclass.
    _opfuse_eager = True

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device,
                                                   requires_grad=requires_grad)

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, requires_grad: bool = False):
        self._data = data
        self._scale_inv = scale_inv

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._data.dtype

    @property
    def rowwise(self) -> bool:
        return self._scale_inv.shape[0] != 1

    @property
    def tag(self) -> str:
        return tag(self.fp8_dtype, self.rowwise)

    def quantized(self) -> Quantized:
        """The payload as a 2-D operand ``[rows, K]``."""
        return Quantized(self._data.reshape(-1, self._data.shape[-1]), self._scale_inv)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        q = self.quantized()
        return dequantize(q.data, q.scale_inv, dtype or self.dtype).reshape(self.shape)

    def __repr__(self) -> str:
        granularity = "row" if self.rowwise else "tensor"
        return (f"Float8Activation({str(self.fp8_dtype).replace('torch.', '')}, scale per {granularity}, "
                f"dtype={str(self.dtype).replace('torch.', '')}, shape={list(self.shape)})")

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0] if args else None
        if func in _SAME_VALUE and isinstance(src, cls):
            if func is not _aten.view.default or tuple(args[1]) == tuple(src.shape):
                return cls(src._data, src._scale_inv, src.dtype)

        def plain(t):
            return t.dequantize() if isinstance(t, cls) else t

        return func(*pytree.tree_map(plain, args), **pytree.tree_map(plain, kwargs))

    def __tensor_flatten__(self):
        return ["_data", "_scale_inv"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Float8Activation(inner["_data"], inner["_scale_inv"], dtype)


def payload(x: torch.Tensor) -> Quantized | None:
    """The FP8 payload of ``x`` as a 2-D operand, or ``None`` for a plain tensor."""
    return x.quantized() if isinstance(x, Float8Activation) else None


def _quantize(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, group) -> Float8Activation:
    if isinstance(x, Float8Activation):
        if x.fp8_dtype == dtype and (x.rowwise == rowwise or x.shape[:-1].numel() <= 1):
            return Float8Activation(x._data, x._scale_inv, x.dtype)
        x = x.dequantize()
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    amax_value = None
    if group is not None and not rowwise:
        # One scale for every rank's shard: the gathered tensor then has one scale too.
        from .numerics import amax

        amax_value = amax(rows, False)
        torch.distributed.all_reduce(amax_value, op=torch.distributed.ReduceOp.MAX, group=group)
    q = quantize(rows, dtype, rowwise, amax_value)
    return Float8Activation(q.data.reshape(x.shape), q.scale_inv, x.dtype)


class _QuantizeFn(torch.autograd.Function):
    """Quantize forward; the gradient passes through unchanged (the GEMM that consumes the FP8
    value quantizes its own backward operands)."""

    @staticmethod
    def forward(ctx, x, dtype, rowwise, group):
        return _quantize(x, dtype, rowwise, group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None, None, None


def quantize_activation(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, group=None) -> Float8Activation:
    """``x`` quantized along its last dim as a :class:`Float8Activation` (differentiable: the
    gradient is the identity). ``group``: a process group whose ranks share one scale (the amax
    is all-reduced), so that the shards they all-gather form one tensor with one scale."""
    return _QuantizeFn.apply(x, dtype, rowwise, group)
