"""Lowering FP8 fusions into a joint (or inference) aten graph.

The generic lowering (:mod:`.lower`) traces each fused module's ``forward``. FP8 fused ops need
two things more, which :class:`Fp8Lowering` adds:

* The FP8 activation between a producer (a norm emitting FP8, a ``quantize``) and the GEMMs that
  read it is a :class:`~opfuse.fp8.Float8Activation` in ``ops.Sequential`` programs; here it is two
  plain values, ``data`` and ``scale`` (:mod:`.fp8_ops`), handed from one call to the next.
* AOTAutograd already wrote the backward into the joint graph, as high-precision GEMMs. For every
  linear that became an FP8 GEMM, its data- and weight-gradient GEMMs (:mod:`.fp8_backward`) are
  replaced by ``opfuse::fp8_linear_backward`` on the FP8 operands the forward kept (the ``x`` it
  quantized, or the producer's payload; for an all-gathered ``x``, the payload gathered again in
  FP8). The partitioner then saves the one-byte ``x``, not the high-precision one. Collectives of the
  backward (the reduce-scatter of an all-gathered input's gradient, the all-gather of a
  reduce-scattered output's gradient) stay the graph's own.
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

from ..core import dispatch as implementations
from ..core.passes.select import forced_implementations
from ..core.passes.token_views import token_view
from ..families.collective_linear.fp8.op import AllGatherLinearFp8, LinearReduceScatterFp8
from ..families.grouped_linear.fp8.op import GroupedGemmFp8
from ..families.grouped_linear.op import GroupedGemm
from ..families.grouped_linear.recognizers import grouped_backward, transformers_grouped_backward
from ..families.linear.fp8.op import Fp8Linear
from ..families.quantize.op import QuantizeActivation
from ..families.residual_norm.op import _NormQuantize
from ..fp8.tensor import tag
from ..machinery.aten import c10d, calls
from ..machinery.implementation import choose, forced_for
from ..ops import group as groups
from ..ops.base import TensorMeta
from ..ops.collectives import AllGather
from . import fp8_aten
from .fp8_backward import LinearGrads
from .fp8_ops import compiled_fp8_gemm, compiled_fp8_gemm_quantizing, compiled_norm_quantize, compiled_quantize
from .lower import LoweringError, _Lowering

__all__ = ["JointLowering", "FP8_FUSED"]

_GEMMS = (Fp8Linear, AllGatherLinearFp8, LinearReduceScatterFp8)
#: Fused modules this lowering handles itself.
FP8_FUSED = (QuantizeActivation, _NormQuantize) + _GEMMS


def _device(node: fx.Node) -> torch.device:
    """The device of a graph value (its fake tensor's: the fused modules hold placeholders)."""
    return node.meta["val"].device


class _QuantizePayload(nn.Module):
    def __init__(self, fused: QuantizeActivation):
        super().__init__()
        self.fused = fused

    def forward(self, x):
        f = self.fused
        return compiled_quantize(x, f._dtype_name(), f.rowwise, f._group(), f._impl())


class _NormQuantizePayload(nn.Module):
    def __init__(self, fused: _NormQuantize):
        super().__init__()
        self.fused = fused

    def forward(self, x, residual=None):
        f = self.fused
        amax_group = groups.group_name(f.amax_group) if f.amax_group is not None else ""
        return compiled_norm_quantize(f.name, x, f.bias, residual, f.weight, f.norm_bias, f.eps, f._group_arg(),
                                      f.write_residual, f.dtype, f.rowwise, amax_group, f._impl())


class _GemmFromPayload(nn.Module):
    """An FP8 GEMM fused op on an input quantized upstream: ``y``."""

    def __init__(self, fused, out_dtype: torch.dtype):
        super().__init__()
        self.fused, self.out_dtype = fused, out_dtype

    def forward(self, data, scale):
        f = self.fused
        group = groups.group_name(f.group) if isinstance(f, (AllGatherLinearFp8, LinearReduceScatterFp8)) else ""
        return compiled_fp8_gemm(f.name, data, scale, f.weight, f.bias, group, self.out_dtype, f.recipe.key(),
                                 f._impl())


class _GemmQuantizing(nn.Module):
    """An FP8 GEMM fused op that quantizes its input itself: ``(y, x_data, x_scale, x_data_t)``."""

    def __init__(self, fused, want_t: bool):
        super().__init__()
        self.fused, self.want_t = fused, want_t

    def forward(self, x):
        f = self.fused
        group = groups.group_name(f.group) if isinstance(f, (AllGatherLinearFp8, LinearReduceScatterFp8)) else ""
        return compiled_fp8_gemm_quantizing(f.name, x, f.weight, f.bias, group, f.recipe.key(), self.want_t, f._impl())


class _GatherPayload(nn.Module):
    """This rank's FP8 operand all-gathered along tokens (bytes as uint8; per-row scales too)."""

    def __init__(self, group_name: str, world: int, rowwise: bool):
        super().__init__()
        self.group_name, self.world, self.rowwise = group_name, world, rowwise

    def forward(self, data, scale):
        c10d = torch.ops._c10d_functional
        raw = c10d.wait_tensor(c10d.all_gather_into_tensor(data.view(torch.uint8), self.world, self.group_name))
        data = raw.view(data.dtype)
        if self.rowwise:
            scale = c10d.wait_tensor(c10d.all_gather_into_tensor(scale, self.world, self.group_name))
        return data, scale


class _Backward(nn.Module):
    """``opfuse::fp8_linear_backward`` -> ``(dx, dw)``."""

    def __init__(self, weight, recipe, impl: str, need_dx: bool, need_dw: bool):
        super().__init__()
        self.weight, self.recipe, self.impl, self.need_dx, self.need_dw = weight, recipe, impl, need_dx, need_dw

    def forward(self, dy, data, scale, data_t=None):
        if data_t is None:
            data_t = torch.empty(0, dtype=data.dtype, device=data.device)
        dx, dw, _ = torch.ops.opfuse.fp8_linear_backward(dy.contiguous(), data.reshape(-1, data.shape[-1]), scale,
                                                         data_t, self.weight, self.recipe.key(), self.need_dx,
                                                         self.need_dw, False, self.impl)
        return dx, dw


class JointLowering(_Lowering):
    """:class:`~.lower._Lowering` plus what joint graphs need beyond tracing a fused op's forward:
    the FP8 fused ops (module docstring) and the backward of grouped GEMMs (the joint graph's
    ``grouped_linear_backward`` is pointed at the implementation the pipeline chose, or replaced
    by the FP8 one). ``grads``: op-graph ``BasicLinear`` node name -> its
    :class:`~.fp8_backward.LinearGrads`; ``hideable``: the backward GEMMs :mod:`.overlap` plans to
    run under a collective (a weight gradient among them gets its own call)."""

    def __init__(self, op_graph, aten_gm, grads: dict[str, LinearGrads] | None = None, hideable=frozenset(),
                 aten_producers: bool = False):
        super().__init__(op_graph, aten_gm)
        self.grads = grads or {}
        #: Write the FP8 producers that have an aten form as aten ops (:func:`.fp8_aten.producers_in_aten`).
        self.aten_producers = aten_producers
        #: The fused nodes written that way, for explain(); the FP8 GEMM + reduce-scatters likewise.
        self.producers_written_as_aten: list[str] = []
        self.scatters_written_as_aten: list[str] = []
        self.gathers_written_as_aten: list[str] = []
        #: Joint-graph GEMMs that .overlap scheduled under a collective (their own op where possible).
        self.hideable = set(hideable)
        self.payloads: dict[str, tuple[fx.Node, fx.Node]] = {}  # op-graph value -> (data, scale)
        self.scale_shared_by: dict[str, str] = {}  # payload -> the group whose ranks share its scale ("" none)

    def lower_fused(self, node: fx.Node, module) -> None:
        if isinstance(module, GroupedGemm):
            super().lower_fused(node, module)
            self._lower_grouped_backward(node, module)
            return
        if not isinstance(module, FP8_FUSED):
            return super().lower_fused(node, module)
        rule = node.meta.get("opfuse_rule", module.name)
        if isinstance(module, _GEMMS):
            self._lower_gemm(node, module, rule)
        else:
            self._lower_producer(node, module, rule)
        for name, _kind in node.meta.get("opfuse_covered", ()):
            region = self.op_graph.regions.get(name)
            if region is not None:
                self.covered |= region.nodes

    # Producers of FP8 activations ------------------------------------------------------------------

    def _lower_producer(self, node, module, rule: str) -> None:
        inputs = [self.value_of(a) for a in node.args]
        quantize = isinstance(module, QuantizeActivation)
        if self.aten_producers and fp8_aten.producer_applies(module):
            wrapper = fp8_aten.ActivationQuantize(module) if quantize else fp8_aten.NormQuantize(module)
            self.producers_written_as_aten.append(f"{node.name} ({module.name})")
        else:
            wrapper = _QuantizePayload(module) if quantize else _NormQuantizePayload(module)
        out = self.emit(wrapper, inputs, where=node.name, tokens_first=True)
        amax_group = getattr(module, "amax_group", None)
        shared = groups.group_name(amax_group) if amax_group is not None else ""
        if quantize:
            self.payloads[node.name] = (out[0], out[1])
            self.scale_shared_by[node.name] = shared
            return
        for user in list(node.users):
            if not (user.op == "call_function" and user.args[0] is node and "opfuse_replaces" in user.meta):
                continue
            if user.args[1] == 0:  # the quantized norm output
                self.payloads[user.name] = (out[0], out[1])
                self.scale_shared_by[user.name] = shared
            else:  # the exported pre-norm sum
                self.replace(user.meta["opfuse_replaces"], out[2], rule, inputs)
                self.values[user.name] = out[2]

    # FP8 GEMMs ------------------------------------------------------------------------------------

    def _linear_node(self, node) -> str:
        for name, kind in node.meta.get("opfuse_covered", ()):
            if kind == "BasicLinear":
                return name
        raise LoweringError(f"opfuse: FP8 fusion {node.name} covers no linear")

    def _gathered(self, group, data: fx.Node, scale: fx.Node, where: str) -> tuple[fx.Node, fx.Node]:
        """An FP8 payload all-gathered along tokens over ``group`` (its per-row scales too)."""
        return self.emit(_GatherPayload(groups.group_name(group), groups.world_size(group),
                                        scale.meta["val"].shape[0] != 1), [data, scale], where=where)

    def _payload_of(self, source) -> tuple[fx.Node, fx.Node] | None:
        """``(data, scale)`` of op-graph value ``source`` where it is FP8: a producer's payload, or
        that payload carried through the all-gathers and token views between the producer and the
        GEMM (the Quantize moved above them, opfuse/core/passes/fp8.py): the gather is emitted on
        the FP8 bytes and the high-precision aten gather and view it stands for are covered.
        ``None`` where ``source`` is not FP8 that way, or where a gather's ranks would not share
        the one scale per tensor (the GEMM then quantizes the high-precision value itself)."""
        if not isinstance(source, fx.Node):
            return None
        if source.name in self.payloads:
            return self.payloads[source.name]
        gather = self.op_graph.gm.get_submodule(source.target) if source.op == "call_module" else None
        if not (isinstance(gather, AllGather) or (gather is None and token_view(source))):
            return None
        inner = self._payload_of(source.args[0])
        if inner is None:
            return None
        shared = self.scale_shared_by.get(source.args[0].name, "")
        if isinstance(gather, AllGather):
            data, scale = inner
            rowwise = scale.meta["val"].shape[0] != 1
            if not rowwise and shared != groups.group_name(gather.group):
                return None  # each rank's own scale: one tensor scale cannot describe the gathered bytes
            inner = self._gathered(gather.group, data, scale, where=source.name)
        # (a token view keeps the [tokens, features] payload as it is: the GEMMs read it 2-D)
        old = self.op_graph.aten.get(source.name)
        if old is not None:
            self.covered.add(old)
            if isinstance(gather, AllGather):
                self.covered |= {a for a in old.all_input_nodes if calls(a, c10d.all_gather_into_tensor)}
        self.payloads[source.name] = inner
        self.scale_shared_by[source.name] = shared
        return inner

    def _lower_gemm(self, node, module, rule: str) -> None:
        source = node.args[0]
        old = self.op_graph.aten.get(node.meta.get("opfuse_replaces"))
        if old is None:
            raise LoweringError(f"opfuse: FP8 fusion {node.name} replaces no value of the graph")
        out_dtype = old.meta["val"].dtype
        data_t = None
        if isinstance(module, Fp8Linear) and self._lower_gemm_aten(node, module, rule, source, old):
            return
        if isinstance(module, (AllGatherLinearFp8, LinearReduceScatterFp8)) and fp8_aten.collectives_in_aten() and \
                self._lower_gemm_aten(node, module, rule, source, old):
            return
        payload = self._payload_of(source)
        if payload is not None:
            data, scale = payload
            y = self.emit(_GemmFromPayload(module, out_dtype), [data, scale], where=node.name)
            inputs = [data, scale]
        else:
            x = self.value_of(source)
            grads = self.grads.get(self._linear_node(node))
            recipe = module.recipe
            # The transposed bytes: for a weight gradient in FP8 with one scale per tensor, from a
            # GPU implementation of fp8_linear (whose backward reads them).
            want_t = (isinstance(module, Fp8Linear) and grads is not None and grads.wgrad is not None
                      and recipe.fp8_wgrad and not recipe.rowwise and module.impl != "reference")
            y, data, scale, data_t = self.emit(_GemmQuantizing(module, want_t), [x], where=node.name,
                                               tokens_first=True)
            inputs = [x]
            if data.meta["val"].numel() == 0:  # not expected: a plain x is quantized by the op
                raise LoweringError(f"opfuse: FP8 fusion {node.name} returned no quantized input")
        self.replace(node.meta["opfuse_replaces"], y, rule, inputs)
        self.values[node.name] = y
        if isinstance(module, AllGatherLinearFp8):  # the backward reads the gathered FP8 x
            data, scale = self._gathered(module.group, data, scale, where=node.name + "_backward")
            data_t = None
        if data_t is not None and data_t.meta["val"].numel() == 0:
            data_t = None
        self._lower_backward(node, module, data, scale, data_t)

    def _lower_gemm_aten(self, node, module, rule: str, source, old) -> bool:
        """Write FP8 GEMM fusion ``node`` as aten ops (:mod:`.fp8_aten`), forward and backward,
        where :func:`.fp8_aten.applies`; ``False`` leaves it to the custom ops. An ``fp8_linear``;
        or (:func:`.fp8_aten.collectives_in_aten`) an all-gather + FP8 GEMM, the gather moving
        FP8 bytes as a functional collective (their scale shared by the group), or an FP8 GEMM +
        reduce-scatter, the GEMM then the reduce-scatter as a functional collective."""
        grads = self.grads.get(self._linear_node(node))
        need_wgrad = grads is not None and grads.wgrad is not None and module.recipe.fp8_wgrad
        payload = self._payload_of(source)
        x = payload[0] if payload is not None else self.value_of(source)
        scatter, gather = isinstance(module, LinearReduceScatterFp8), isinstance(module, AllGatherLinearFp8)
        shape = tuple(x.meta["val"].shape)
        if gather:
            shape = (shape[0] * groups.world_size(module.group),) + shape[1:]
            if payload is not None and self.scale_shared_by.get(source.name, "") != groups.group_name(module.group):
                return False  # each rank's own scale: one tensor scale cannot describe the gathered bytes
        # The GEMM of a collective GEMM runs where fp8_linear's implementation would.
        impl = self._gemm_impl(module, x, old.meta["val"].dtype, payload is not None) if scatter or gather \
            else module.impl
        if fp8_aten.applies(impl, module.recipe, shape, need_wgrad) is not None:
            return False
        bias = None if scatter else module.bias  # added once, after the sum
        if gather:
            if payload is None:  # quantized here with the group's amax, so the gathered bytes share one scale
                name = groups.group_name(module.group)
                payload = tuple(self.emit(fp8_aten.SharedQuantize(module.recipe.forward_dtype, name,
                                                                  groups.world_size(module.group)),
                                          [x], where=node.name + "_quantize", tokens_first=True))
            payload = self._gathered(module.group, *payload, where=node.name + "_gather")
            self.gathers_written_as_aten.append(node.name)
        # The data gradient's W operand is written by the forward (one quantization of W per step).
        need_dgrad = grads is not None and grads.dgrad is not None
        weight_t = None
        if payload is not None:
            inputs = list(payload)
            gemm = fp8_aten.GemmFromPayload(module.weight, bias, module.recipe, old.meta["val"].dtype, need_dgrad)
            out = self.emit(gemm.reserve(_device(inputs[0])), inputs, where=node.name)
            y, weight_t = (out[0], tuple(out[1:])) if need_dgrad else (out, None)
            data, scale, data_t = payload[0], payload[1], None
        else:
            inputs = [x]
            gemm = fp8_aten.GemmQuantizing(module.weight, bias, module.recipe, need_wgrad, need_dgrad)
            out = self.emit(gemm.reserve(_device(x)), inputs, where=node.name, tokens_first=True)
            y, data, scale = out[:3]
            data_t = out[3] if need_wgrad else None
            weight_t = tuple(out[-2:]) if need_dgrad else None
        if scatter:
            y = self.emit(fp8_aten.ReduceScatterTokens(groups.group_name(module.group), groups.world_size(module.group),
                                                       module.bias), [y], where=node.name + "_scatter")
            self.scatters_written_as_aten.append(node.name)
        self.replace(node.meta["opfuse_replaces"], y, rule, inputs)
        self.values[node.name] = y
        self._lower_backward(node, module, data, scale, data_t, aten=True, weight_t=weight_t)
        return True

    def _lower_backward(self, node, module, data, scale, data_t, aten: bool = False, weight_t=None) -> None:
        grads = self.grads.get(self._linear_node(node))
        if grads is None or not grads.nodes:
            return
        need_dx, need_dw = grads.dgrad is not None, grads.wgrad is not None
        if not aten:
            # A forward left to a custom op (a collective FP8 GEMM, a token count the aten forward
            # does not take) may still have its backward GEMMs written as aten ops.
            impl = self._backward_impl(module, grads, data)
            aten = fp8_aten.applies(impl, module.recipe, data.meta["val"].shape,
                                    need_dw and module.recipe.fp8_wgrad) is None
        if aten:
            backward = fp8_aten.Backward(module.weight, module.recipe, need_dx, need_dw).reserve(_device(grads.dy))
            args = [grads.dy, data, scale, data_t, *(weight_t or (None, None))]
        else:
            if data_t is not None and impl != module.impl:
                data_t = None  # transposed bytes are written for the implementation that reads them
            args = [grads.dy, data, scale] + ([data_t] if data_t is not None else [])
            if need_dx and need_dw and grads.wgrad in self.hideable:
                # The weight gradient is to run under a collective of the data gradient
                # (.overlap): two calls, so the schedule can put the collective between them
                # (the op quantizes dy in each: one more read of dy, against a hidden collective).
                dx, _ = self.emit(_Backward(module.weight, module.recipe, impl, True, False), args,
                                  where=node.name + "_backward")
                _, dw = self.emit(_Backward(module.weight, module.recipe, impl, False, True), args,
                                  where=node.name + "_wgrad")
                self._swap_grads(grads, dx, dw, need_dx, need_dw)
                return
            backward = _Backward(module.weight, module.recipe, impl, need_dx, need_dw)
        dx, dw = self.emit(backward, args, where=node.name + "_backward")
        self._swap_grads(grads, dx, dw, need_dx, need_dw)

    def _swap_grads(self, grads: LinearGrads, dx, dw, need_dx: bool, need_dw: bool) -> None:
        """The joint graph's backward GEMMs of one linear replaced by ``dx`` and ``dw``."""
        if need_dx:
            self._swap(grads.dgrad, dx)
        if need_dw:
            if grads.wgrad_transposed:
                with self.graph.inserting_after(dw):
                    dw_t = self.graph.call_function(torch.ops.aten.permute.default, (dw, [1, 0]))
                dw_t.meta["val"] = dw.meta["val"].permute(1, 0)
                dw = dw_t
            self._swap(grads.wgrad, dw)

    def _swap(self, old: fx.Node, new: fx.Node) -> None:
        got, want = new.meta["val"], old.meta["val"]
        if got.shape != want.shape or got.dtype != want.dtype:
            raise LoweringError(f"opfuse: FP8 backward GEMM gives {got.dtype}{list(got.shape)} for {old.name}, which "
                                f"holds {want.dtype}{list(want.shape)}")
        old.replace_all_uses_with(new)
        self.covered.add(old)

    # Grouped GEMMs ------------------------------------------------------------------------------

    def _lower_grouped_backward(self, node, module) -> None:
        """Point the joint graph's grouped backward at the chosen implementation (the FP8 one for
        ``grouped_linear_fp8``: dgrad on FP8 operands, as its forward)."""
        region = next((self.op_graph.regions.get(name) for name, _ in node.meta.get("opfuse_covered", ())
                       if name in self.op_graph.regions), None)
        backward = grouped_backward(region.value) if region is not None else None
        if backward is None:
            if region is not None and not isinstance(module, GroupedGemmFp8):
                self._replace_transformers_backward(region.value, module)
            return
        dy, x, sizes, weight, bias, fsdp, _impl, need_dx, need_dw, need_db = backward.args
        if not isinstance(module, GroupedGemmFp8):
            backward.update_arg(6, module.impl)
            return
        with self.graph.inserting_before(backward):
            new = self.graph.call_function(
                torch.ops.opfuse.grouped_linear_fp8_backward.default,
                (dy, x, sizes, weight, bias, fsdp, module.num_groups, module.recipe.key(), need_dx, need_dw, need_db,
                 module.impl))
        # Not the old op's ``eager_input_vals``: Inductor normalizes them against the new op's schema
        # (a different one) to constrain layouts; a node a pass inserted goes without.
        new.meta.update({k: v for k, v in backward.meta.items() if k != "eager_input_vals"})
        backward.replace_all_uses_with(new)
        self.graph.erase_node(backward)

    def _replace_transformers_backward(self, forward: fx.Node, module) -> None:
        """transformers' ``grouped_mm_fallback_backward`` (a loop over offsets read on the host) of
        the recognised ``forward``, replaced by ``grouped_linear_backward`` on the chosen
        implementation; its weight gradient is laid out as the op's weight argument, ``W``'s
        transpose, hence the permute. Under FP8 it stays: the forward's FP8 payloads are not its."""
        backward = transformers_grouped_backward(forward)
        if backward is None:
            return
        x, weight_t, offs, dy = backward.args
        weight, sizes = weight_t.args[0], offs.args[0]
        args = (dy, x, sizes, weight, None, "", module.impl, True, True, False)
        with self.graph.inserting_before(backward):
            new = self.graph.call_function(torch.ops.opfuse.grouped_linear_backward.default, args)
            dx = self.graph.call_function(operator.getitem, (new, 0))
            dw = self.graph.call_function(operator.getitem, (new, 1))
            dw_t = self.graph.call_function(torch.ops.aten.permute.default, (dw, [0, 2, 1]))
        with self.fake_mode:
            fake = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
            out = torch.ops.opfuse.grouped_linear_backward.default(*fake)
            new.meta["val"], dx.meta["val"], dw.meta["val"] = out, out[0], out[1]
            dw_t.meta["val"] = out[1].permute(0, 2, 1)
        for user in list(backward.users):
            if not (user.op == "call_function" and user.target is operator.getitem):
                raise LoweringError(f"{backward.name}: transformers' grouped backward read other than by index "
                                    f"({user.name}: {user.target})")
            user.replace_all_uses_with(dx if user.args[1] == 0 else dw_t)
            self.graph.erase_node(user)
        self.graph.erase_node(backward)

    def _gemm_impl(self, module, x: fx.Node, dtype: torch.dtype, quantized: bool) -> str:
        """The ``fp8_linear`` implementation that would run ``module``'s GEMM on ``x`` (an FP8
        payload's data when ``quantized``; ``dtype``: the activations')."""
        val = x.meta["val"]
        meta = TensorMeta(tuple(val.shape), dtype, val.device, True,
                          quantized=tag(module.recipe.forward_dtype, module.recipe.rowwise) if quantized else None)
        spec = Fp8Linear(weight=module.weight, bias=None, recipe=module.recipe).call_spec([meta])
        impls = implementations.for_op("fp8_linear", spec)
        return choose(spec, impls, forced_for("fp8_linear", impls, forced_implementations())).name

    def _backward_impl(self, module, grads: LinearGrads, data) -> str:
        """The ``fp8_linear`` implementation for the backward GEMMs (the forward's when it is one)."""
        if isinstance(module, Fp8Linear):
            return module.impl
        dy = grads.dy.meta["val"]
        weight = module.weight
        x = TensorMeta(tuple(data.meta["val"].shape), dy.dtype, dy.device, True,
                       quantized=tag(module.recipe.forward_dtype, module.recipe.rowwise))
        spec = Fp8Linear(weight=weight, bias=None, recipe=module.recipe).call_spec([x])
        impls = implementations.for_op("fp8_linear", spec)
        return choose(spec, impls, forced_for("fp8_linear", impls, forced_implementations())).name
