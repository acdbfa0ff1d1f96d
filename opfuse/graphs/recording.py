"""One recorded signature of :func:`opfuse.graphed`: its static buffers, the per-call checks
(signature, parameter addresses), and the ``autograd.Function`` that replays
its forward and backward recordings.

See :mod:`opfuse.graphs.graphed` for the rules these implement.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ..ops.base import OpInputError, TensorMeta

__all__ = ["GraphSignatureError", "GraphCaptureError", "Capture", "ReplayFunction", "describe", "describe_all",
           "mismatch"]


class GraphSignatureError(OpInputError):
    """A graphed block was called with inputs that do not match a captured signature."""


class GraphCaptureError(RuntimeError):
    """Recording a block as a CUDA graph failed, or would have run something other than eager."""


# Signatures -------------------------------------------------------------------------------------


def describe(meta: TensorMeta, with_grad: bool = True) -> str:
    return str(meta) + (" (requires grad)" if with_grad and meta.requires_grad else "")


def describe_all(metas, with_grad: bool = True) -> str:
    return "(" + ", ".join(describe(m, with_grad) for m in metas) + ")"


def mismatch(expected, received, *, check_grad: bool) -> Optional[str]:
    """The first difference between two input signatures (lists of :class:`TensorMeta`), as a
    sentence, or ``None`` when they match. ``check_grad``: compare ``requires_grad`` too."""
    if len(expected) != len(received):
        return f"{len(received)} input(s) given, the captured graph takes {len(expected)}"
    for index, (want, got) in enumerate(zip(expected, received)):
        if tuple(got.shape) != tuple(want.shape):
            return (f"input {index} has shape [{', '.join(map(str, got.shape))}], the captured graph expects "
                    f"[{', '.join(map(str, want.shape))}]")
        if got.dtype != want.dtype:
            return f"input {index} has dtype {got.dtype}, the captured graph expects {want.dtype}"
        if torch.device(got.device) != torch.device(want.device):
            return f"input {index} is on {got.device}, the captured graph expects {want.device}"
        if check_grad and got.requires_grad != want.requires_grad:
            return (f"input {index} has requires_grad={got.requires_grad}, the captured graph was recorded with "
                    f"requires_grad={want.requires_grad}")
    return None


# One recorded signature ---------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Capture:
    """The recording of one input signature (built by ``GraphedModule._capture``)."""

    metas: tuple                 # TensorMeta per input, as captured
    training: bool               # a backward graph exists
    replayer: object
    static_inputs: tuple
    static_outputs: tuple        # flat
    out_spec: object             # pytree spec of the module's output
    differentiable: tuple        # per flat output
    static_grad_outputs: tuple   # per flat output (None: not differentiable)
    params: tuple                # the module's parameters at capture
    param_storage: tuple         # detached aliases of the captured parameter storage
    param_ptrs: tuple
    param_requires_grad: tuple
    param_grads: tuple = ()      # static gradient per parameter (None: no grad)
    input_grads: tuple = ()      # static gradient per input (None: no grad)
    programs: tuple = ()         # keeps the programs the graphs were recorded from alive
    generation: int = 0          # forward replays so far
    warned: set = dataclasses.field(default_factory=set)

    @property
    def device(self) -> torch.device:
        return torch.device(self.metas[0].device)

    def matches(self, inputs, grad: bool) -> Optional[str]:
        """``None`` when this capture can run ``inputs`` (as many as ``metas``) under grad mode
        ``grad``, else why not. Runs on every call: the matching path builds nothing."""
        needs_grad = grad and (any(t.requires_grad for t in inputs) or any(p.requires_grad for p in self.params))
        if needs_grad and not self.training:
            return ("the graph was captured without backward (for inference), but gradients are needed: call it "
                    "under torch.no_grad(), or capture with gradients enabled (backward=True)")
        if needs_grad:
            for index, (param, was) in enumerate(zip(self.params, self.param_requires_grad)):
                if param.requires_grad != was:
                    return (f"parameter {index} has requires_grad={param.requires_grad}, the graph was captured with "
                            f"requires_grad={was}")
        for t, meta in zip(inputs, self.metas):
            if t.shape != meta.shape or t.dtype != meta.dtype or t.device != meta.device or \
                    (needs_grad and t.requires_grad != meta.requires_grad):
                return mismatch(self.metas, [TensorMeta.of(t) for t in inputs], check_grad=needs_grad)
        return None

    def refresh_params(self) -> None:
        for index, (param, storage, ptr) in enumerate(zip(self.params, self.param_storage, self.param_ptrs)):
            if param.data_ptr() == ptr:
                continue
            if param.shape != storage.shape or param.dtype != storage.dtype or param.device != storage.device:
                raise GraphSignatureError(
                    f"opfuse.graphed: parameter {index} is now {describe(TensorMeta.of(param), False)}, the graph "
                    f"was captured with {describe(TensorMeta.of(storage), False)}; capture again")
            if index not in self.warned:
                self.warned.add(index)
                warnings.warn(
                    f"opfuse.graphed: parameter {index} ({describe(TensorMeta.of(param), False)}) was re-allocated "
                    f"after capture (param.data = ...); its values are copied into the captured storage on every "
                    f"call. Update parameters in place, or capture again, to avoid the copy.", stacklevel=4)
            with torch.no_grad():
                storage.copy_(param)

    def copy_inputs(self, inputs) -> None:
        with torch.no_grad():
            for static, value in zip(self.static_inputs, inputs):
                if value is not static:
                    static.copy_(value)  # a no-op for another view of the same data

    def replay_forward(self) -> None:
        self.replayer.replay_forward()
        self.generation += 1

    def outputs(self, clone: bool) -> list:
        return [o.clone() if clone else o.detach() for o in self.static_outputs]


class ReplayFunction(torch.autograd.Function):
    """Forward: copy inputs, replay the forward graph. Backward: copy the output gradients,
    replay the backward graph, hand out the static gradients."""

    @staticmethod
    def forward(ctx, capture: Capture, clone: bool, count: int, *tensors):
        inputs = tensors[:count]
        capture.copy_inputs(inputs)
        capture.replay_forward()
        ctx.capture, ctx.generation = capture, capture.generation
        outputs = capture.outputs(clone)
        fixed = [o for o, d in zip(outputs, capture.differentiable) if not d]
        if fixed:
            ctx.mark_non_differentiable(*fixed)
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        capture = ctx.capture
        if ctx.generation != capture.generation:
            raise RuntimeError(
                f"opfuse.graphed: backward of call {ctx.generation}, but the graph has replayed its forward "
                f"{capture.generation - ctx.generation} more time(s) since, overwriting the activations this backward "
                f"needs. Run backward before calling the graphed block again (or use separate graphed copies).")
        with torch.no_grad():
            for static, grad in zip(capture.static_grad_outputs, grads):
                if static is None:
                    continue
                if grad is None:
                    static.zero_()
                elif grad is not static:
                    static.copy_(grad)
        capture.replayer.replay_backward()
        # Fresh copies: autograd adopts a returned gradient as ``.grad`` when nothing else holds
        # it, and a ``.grad`` aliasing a static buffer would be rewritten (doubled, on
        # accumulation) by the next replay. Handing out aliases was tried and failed that test on
        # the GPU; one copy per gradient is the price of always-correct accumulation.
        return (None, None, None) + tuple(None if g is None else g.clone()
                                          for g in capture.input_grads + capture.param_grads)
