"""FP8 linears written into compiled graphs as aten ops: the quantization (amax, scale, saturating
cast, transposed bytes) and ``torch._scaled_mm``, forward and backward.

Elsewhere an FP8 GEMM of a compiled graph is a custom op (:mod:`.fp8_ops`) whose body runs the
chosen implementation's Python: per call a few dozen torch calls and a Triton launch, on the host,
in line. A training step of a large model has 30-40 of them, and on a GPU host that Python made the
FP8 step host-bound (docs/PERF_NOTES.model.md, session 7). Written as aten ops instead, the same
arithmetic goes through Inductor like the rest of the graph: the amax reductions and casts become
Triton kernels it fuses with their neighbours and launches from generated code, and the GEMMs are
``torch._scaled_mm`` extern calls. The fused producers (all-reduce + add + RMSNorm + quantize,
add + norm + quantize) stay opfuse kernels: they hand their ``(data, scale)`` to these modules.

The arithmetic is the recipe's definition (:mod:`opfuse.fp8.numerics`): amax = max |x|,
scale = fp8_max / amax (1 where amax is 0), data = saturate(x * scale), dequantization factor
1 / scale; GEMMs accumulate in float32 and round once. With ``pow2_weight_scales`` the weights'
scales are powers of two and their quantization is opfuse's one-read custom op instead. It applies to one scale per tensor
(``TensorScaling``) on ``fp8_linear`` (:func:`applies` says where). The collective FP8 GEMMs
(all-gather / reduce-scatter) keep a custom op for their forward, and their backward GEMMs are
:class:`Backward`; per-row scales keep the custom ops throughout.

The producers have an aten form too (:class:`NormQuantize`, :class:`ActivationQuantize`), and
so have the collective FP8 GEMMs (an FP8 all-gather as a functional collective, then the GEMM;
the GEMM, then :class:`ReduceScatterTokens`; only with ``fp8_aten="always"``:
:func:`collectives_in_aten`), for graphs
compiled without CUDA graphs (:func:`producers_in_aten`): there each custom-op call of opfuse's
norm + quantize kernels costs ~100 us of host time (its allocations, launches and
tensor-subclass payload) and each call of the FP8 GEMM + reduce-scatter ~800 us under the
profiler, while Inductor launches the same work as a few generated kernels, an extern GEMM and a
functional collective. Under CUDA graphs the host cost is gone and opfuse's kernels (and the
GEMM + reduce-scatter's overlap over peer memory) stay.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..config import config
from ..families.quantize import weight_pow2
from ..families.residual_norm import reference as norm_reference
from ..fp8.numerics import fp8_max, scales_from_amax
from ..fp8.recipe import E4M3, E5M2
from ..ops import group as groups

__all__ = ["IMPLEMENTATIONS", "applies", "quantize", "scaled_mm", "GemmQuantizing", "GemmFromPayload", "Backward",
           "producers_in_aten", "collectives_in_aten", "quantize_activation", "NormQuantize", "ActivationQuantize", "SharedQuantize",
           "ReduceScatterTokens"]

#: ``fp8_linear`` implementations whose GEMMs the compile front end writes as aten ops: those built
#: on ``torch._scaled_mm`` (the same GEMM, minus the Python around it).
IMPLEMENTATIONS = {"scaled_mm"}


def applies(impl: str, recipe, shape, need_fp8_wgrad: bool) -> str | None:
    """``None`` where an ``fp8_linear`` fusion on implementation ``impl`` is written as aten ops,
    else why not. ``shape``: its input's (every leading dim a token dim; sizes may be symbolic)."""
    rows = math.prod(shape[:-1])
    if impl not in IMPLEMENTATIONS:
        return f"implementation {impl} is not built on torch._scaled_mm"
    if recipe.rowwise:
        return "per-row scales"
    if need_fp8_wgrad and (not isinstance(rows, int) or rows % 16):
        # The weight gradient contracts over the tokens: torch._scaled_mm needs a multiple of 16,
        # which the implementation's own path pads to.
        return f"{rows} tokens (the FP8 weight gradient needs a static multiple of 16)"
    return None


def quantize(x: torch.Tensor, dtype: torch.dtype, transpose: bool = False):
    """``(data, scale_inv, data_t)`` of 2-D ``x`` with one scale (``data_t``: the transposed
    bytes, or ``None``)."""
    data, scale_inv = quantize_activation(x, dtype, False)
    return data, scale_inv, (data.t().contiguous() if transpose else None)


class _WeightQuantizer(nn.Module):
    """Quantizes ``weight`` per the recipe: the aten ops of :func:`quantize`, or with
    ``pow2_weight_scales`` opfuse's one-read quantizer (``opfuse::quantize_weight_pow2``, one hint
    per module: see :mod:`opfuse.families.quantize.weight_pow2`), which Inductor calls as it is.
    The lowering reserves the hint (:meth:`reserve`) with the graph's device: the parameters it
    holds here are placeholders."""

    def __init__(self, weight: nn.Parameter, recipe):
        super().__init__()
        self.weight, self.recipe = weight, recipe
        self.hint_key = weight_pow2.new_key() if recipe.pow2_weight_scales else None

    def reserve(self, device: torch.device) -> "_WeightQuantizer":
        """Make the hint on ``device`` now, outside any CUDA-graph pool (the op makes none)."""
        if self.hint_key is not None:
            weight_pow2.reserve_hint(self.hint_key, device)
        return self

    def quantize_weight(self, transpose: bool):
        dtype = self.recipe.forward_dtype
        if self.hint_key is None:
            return quantize(self.weight, dtype, transpose)
        data, scale_inv, data_t = torch.ops.opfuse.quantize_weight_pow2(
            self.weight, self.hint_key, weight_pow2.dtype_name(dtype), transpose)
        return data, scale_inv, (data_t if transpose else None)


def producers_in_aten(inductor: bool, cuda_graphs: bool) -> bool:
    """Whether a graph's FP8 producers (norm + quantize, quantize) are written as aten ops
    (``opfuse.config.fp8_aten``: ``auto`` where Inductor compiles the graph without CUDA graphs,
    ``always``, ``never``). The all-reduce + add + RMSNorm + quantize keeps its peer-memory
    kernels either way (:func:`producer_applies`)."""
    if config.fp8_aten == "auto":
        return inductor and not cuda_graphs
    return config.fp8_aten == "always"


def collectives_in_aten() -> bool:
    """Whether the collective FP8 GEMMs (all-gather + GEMM, GEMM + reduce-scatter) are written as
    aten ops: only with ``opfuse.config.fp8_aten="always"``. Their backward then schedules its
    weight-gradient GEMMs under the collectives differently (``tests/unit/test_compile_overlap.py``
    keeps the custom ops' schedule), and no GPU has measured that form yet."""
    return config.fp8_aten == "always"


def producer_applies(fused) -> bool:
    """Whether FP8 producer ``fused`` has an aten form: a quantize, or a norm + quantize with no
    all-reduce in it."""
    return not getattr(fused, "reduces", False)


def quantize_activation(x: torch.Tensor, dtype: torch.dtype, rowwise: bool, amax_group: str = "",
                        world: int = 1):
    """``(data, scale_inv)`` of 2-D ``x``, one scale per row or per tensor; a tensor's amax is
    all-reduced (max) over ``amax_group`` (``world`` ranks) first, so that the ranks' shards
    gathered next share one scale (:func:`opfuse.families.quantize.reference.share_amax`)."""
    limit = fp8_max(dtype)
    if statically_known_true(x.shape[0] == 0):  # (a symbolic token count is taken to be nonzero)
        a = x.new_zeros((0 if rowwise else 1, 1), dtype=torch.float32)
    elif rowwise:
        a = x.abs().amax(dim=-1, keepdim=True).float()
    else:
        a = x.abs().amax().float().reshape(1, 1)
        if amax_group and world > 1:
            c10d = torch.ops._c10d_functional
            a = c10d.wait_tensor(c10d.all_reduce(a, "max", amax_group))
    scale, scale_inv = scales_from_amax(a, dtype)
    return (x.float() * scale).clamp(-limit, limit).to(dtype), scale_inv


#: The norm + quantize ops' ``dtype`` argument.
_FP8 = {"e4m3": E4M3, "e5m2": E5M2}


def _world(group: str) -> int:
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_group_size_by_name(group) if group else 1


class ActivationQuantize(nn.Module):
    """The ``quantize`` fused op as aten ops: ``(data, scale)`` of ``x`` (any leading dims)."""

    def __init__(self, fused):
        super().__init__()
        self.fused = fused

    def forward(self, x):
        f = self.fused
        group = f._group()
        data, scale = quantize_activation(x.reshape(-1, x.shape[-1]), f.dtype, f.rowwise, group, _world(group))
        return data.view(x.shape), scale


class NormQuantize(nn.Module):
    """``add_rmsnorm_quantize`` / ``add_layernorm_quantize`` as aten ops: ``(data, scale, h)``,
    the norm's output rounded to the activation dtype and then quantized, as the kernels do
    (``h`` empty unless the fused op writes the residual). The norm's backward is the joint
    graph's own, as for the kernels' form."""

    def __init__(self, fused):
        super().__init__()
        self.fused = fused

    def forward(self, x, residual=None):
        f = self.fused
        y, h = norm_reference.forward(x, f.bias, residual, f.weight, f.norm_bias, f.eps, "", f.write_residual,
                                      norm=f.norm)
        group = groups.group_name(f.amax_group) if f.amax_group is not None else ""
        data, scale = quantize_activation(y.reshape(-1, y.shape[-1]), _FP8[f.dtype], f.rowwise, group,
                                          _world(group))
        return data.view(x.shape), scale, h


class SharedQuantize(nn.Module):
    """``(data, scale)`` of 2-D ``x`` with one scale per tensor from the amax all-reduced over
    ``group_name`` (``world`` ranks): the operand of an FP8 all-gather whose input came unquantized."""

    def __init__(self, dtype: torch.dtype, group_name: str, world: int):
        super().__init__()
        self.dtype, self.group_name, self.world = dtype, group_name, world

    def forward(self, x):
        return quantize_activation(x, self.dtype, False, self.group_name, self.world)


class ReduceScatterTokens(nn.Module):
    """``reduce_scatter_tokens(y) [+ bias]`` as a functional collective: the second half of
    ``linear_reduce_scatter_fp8`` written as aten ops (the FP8 GEMM before it without its bias,
    which is added once, after the sum)."""

    def __init__(self, group_name: str, world: int, bias):
        super().__init__()
        self.group_name, self.world, self.bias = group_name, world, bias

    def forward(self, y):
        c10d = torch.ops._c10d_functional
        out = c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", self.world, self.group_name))
        return out if self.bias is None else out + self.bias


def scaled_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``dequantize(a) @ dequantize(b).T (+ bias)``: ``a`` ``[M, K]``, ``b`` ``[N, K]`` (rows =
    output columns), both row-major."""
    return torch._scaled_mm(a, b.t(), a_scale.reshape(()), b_scale.reshape(()), bias=bias, out_dtype=out_dtype)


class GemmQuantizing(_WeightQuantizer):
    """``y = x @ W.T (+ b)`` quantizing ``x`` and ``W``: ``(y, x_data, x_scale)``, then ``x_data_t``
    when ``want_t`` (the FP8 weight gradient reads it), then ``(w_data_t, w_scale)`` when
    ``want_weight_t`` (the data gradient's ``W`` operand, written here from the same amax so that
    the backward does not quantize every weight again)."""

    def __init__(self, weight: nn.Parameter, bias, recipe, want_t: bool, want_weight_t: bool = False):
        super().__init__(weight, recipe)
        self.bias = bias
        self.want_t, self.want_weight_t = want_t, want_weight_t

    def forward(self, x):
        data, scale, data_t = quantize(x, self.recipe.forward_dtype, self.want_t)
        w_data, w_scale, w_data_t = self.quantize_weight(self.want_weight_t)
        y = scaled_mm(data, scale, w_data, w_scale, x.dtype, self.bias)
        return (y, data, scale) + ((data_t,) if self.want_t else ()) + \
            ((w_data_t, w_scale) if self.want_weight_t else ())


class GemmFromPayload(_WeightQuantizer):
    """``y`` from an input quantized upstream (``data``, ``scale``); with ``want_weight_t``
    ``(y, w_data_t, w_scale)`` (:class:`GemmQuantizing`)."""

    def __init__(self, weight: nn.Parameter, bias, recipe, out_dtype: torch.dtype, want_weight_t: bool = False):
        super().__init__(weight, recipe)
        self.bias, self.out_dtype = bias, out_dtype
        self.want_weight_t = want_weight_t

    def forward(self, data, scale):
        w_data, w_scale, w_data_t = self.quantize_weight(self.want_weight_t)
        k = data.shape[-1]
        y = scaled_mm(data.reshape(-1, k), scale, w_data, w_scale, self.out_dtype, self.bias)
        return (y, w_data_t, w_scale) if self.want_weight_t else y


class Backward(_WeightQuantizer):
    """``(dx, dW)`` of an FP8 linear from ``dy`` and the FP8 ``x`` its forward kept (``data_t``:
    its transposed bytes where the forward wrote them; ``w_data_t``, ``w_scale``: ``W``'s
    transposed bytes and scale where the forward wrote them, else quantized here). Empty where not
    needed."""

    def __init__(self, weight: nn.Parameter, recipe, need_dx: bool, need_dw: bool):
        super().__init__(weight, recipe)
        self.need_dx, self.need_dw = need_dx, need_dw

    def forward(self, dy, data, scale, data_t=None, w_data_t=None, w_scale=None):
        r = self.recipe
        n, k = self.weight.shape
        dy2 = dy.reshape(-1, n)
        fp8_wgrad = self.need_dw and r.fp8_wgrad
        dx = dw = dy2.new_empty(0)
        if self.need_dx or fp8_wgrad:
            dy_data, dy_scale, dy_t = quantize(dy2, r.grad_dtype, transpose=fp8_wgrad)
        if self.need_dx:
            if w_data_t is None:
                _, w_scale, w_data_t = self.quantize_weight(transpose=True)
            # dx = dy @ W: W's bytes transposed keep W's scale (one per tensor).
            dx = scaled_mm(dy_data, dy_scale, w_data_t, w_scale, dy.dtype)
        if self.need_dw:
            x_data = data.reshape(-1, k)
            if fp8_wgrad:
                x_t = data_t if data_t is not None else x_data.t().contiguous()
                dw = scaled_mm(dy_t, dy_scale, x_t, scale, self.weight.dtype)
            else:  # the recipe keeps the weight gradient in high precision
                dw = (dy2.float().t() @ (x_data.float() * scale)).to(self.weight.dtype)
        return dx, dw
