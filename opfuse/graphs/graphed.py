"""``opfuse.graphed``: run a block as CUDA graphs, forward and (when gradients are needed) backward.

At decode sizes an eager block is bound by the host (a tiny eager torch op costs ~21 us of host
time, an empty kernel inside a CUDA graph 0.5 us), so fused kernels only pay off when the block
replays as a graph. ``graphed(block, *sample_inputs)`` records one call of ``block`` for the
samples' signature and returns a :class:`GraphedModule` that, per call, copies the inputs into
static buffers and replays the recording.

What it does beyond ``torch.cuda.make_graphed_callables``:

* **opfuse-aware warm-up.** The block runs a few times (forward, and backward through
  ``torch.autograd.grad``) on a side stream under the grad mode of the capture, so the
  ``Sequential``'s program cache holds the exact program the capture will run: implementations
  chosen, symmetric-memory regions reserved and initialised, overlap plans bound, NCCL
  communicators created. A program compiled *during* capture (its capability checks would see a
  capture in progress and fall back) is a :class:`GraphCaptureError`, not a silent slowdown.
* **Parameters by address.** The graphs read parameters where they live, so in-place optimizer
  updates (``optimizer.step()``, ``p.add_``, ``load_state_dict``) are seen by the next replay. A
  parameter re-allocated after capture (``p.data = ...``) is copied into the captured storage on
  every call (with a warning once); a changed shape or dtype is an error.
* **Gradients.** Backward replays the captured backward graph through an
  ``autograd.Function``; parameter and input gradients flow into autograd as usual. Returned
  gradients are copies of the static gradient buffers (so ``.grad`` never aliases a buffer the
  next replay rewrites, and accumulation without ``zero_grad`` stays correct).
  Backward of a call whose activations a later forward replay overwrote raises.
* **Signatures.** A call whose inputs differ in shape, dtype, device or ``requires_grad`` from the
  captured ones raises :class:`GraphSignatureError` naming both signatures; with
  ``recapture=True`` it records (warm-up + capture) a graph for the new signature instead, kept
  alongside the others.

Buffer lifetimes: outputs (and gradients) are the graph's static tensors, overwritten by the next
replay, as with ``torch.cuda.make_graphed_callables``. Consume or clone them before the next
call, or pass ``clone_outputs=True``. Do not modify outputs in place before backward: saved
activations may be among them.

Every rank must capture the same signatures in the same order (warm-up and capture run
collectives). opfuse settings (``opfuse.config``) are frozen into a capture.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..ops.base import OpInputError, TensorMeta
from ..sequential.block import Sequential
from .recording import Capture, GraphCaptureError, GraphSignatureError, ReplayFunction, describe_all, mismatch
from .recorders import REPLAY_MODES, make_replayer

__all__ = ["graphed", "GraphedModule", "GraphSignatureError", "GraphCaptureError", "REPLAY_MODES", "mismatch"]


def _check_tensors(inputs, who: str) -> None:
    if not inputs:
        raise OpInputError(f"{who}: no inputs; pass the block's inputs as sample tensors")
    for index, value in enumerate(inputs):
        if not isinstance(value, torch.Tensor):
            raise OpInputError(f"{who}: input {index} is a {type(value).__name__}; expected a torch.Tensor")


def _program_keys(module: nn.Module) -> dict:
    return {id(m): set(m._programs) for m in module.modules() if isinstance(m, Sequential)}


def _programs(module: nn.Module) -> list:
    return [p for m in module.modules() if isinstance(m, Sequential) for p in m._programs.values()]


# The module --------------------------------------------------------------------------------------


class GraphedModule(nn.Module):
    """``module`` recorded as CUDA graphs; built by :func:`graphed`. Call it like ``module``.

    Attributes
    ----------
    module:
        The wrapped block (its parameters are this module's parameters).
    captures:
        The recorded signatures, most recent first: each has ``metas`` (the inputs'
        :class:`~opfuse.ops.base.TensorMeta`), ``training`` (a backward graph exists),
        ``static_inputs`` and ``static_outputs``.
    """

    def __init__(self, module: nn.Module, *, backward: Optional[bool], clone_outputs: bool, recapture: bool,
                 warmup: int, pool, replay: str):
        super().__init__()
        self.module = module
        self.backward_mode = backward
        self.clone_outputs = clone_outputs
        self.recapture = recapture
        self.warmup = warmup
        self.pool = pool
        self.replay = replay
        self.captures: list[Capture] = []

    # Calling -------------------------------------------------------------------------------------

    def forward(self, *inputs):
        capture = self._select(inputs)
        capture.refresh_params()
        if capture.training and torch.is_grad_enabled():
            flat = ReplayFunction.apply(capture, self.clone_outputs, len(inputs), *inputs, *capture.params)
        else:
            capture.copy_inputs(inputs)
            capture.replay_forward()
            flat = capture.outputs(self.clone_outputs)
        return pytree.tree_unflatten(list(flat), capture.out_spec)

    def _select(self, inputs) -> Capture:
        grad = torch.is_grad_enabled()
        reasons = []
        for capture in self.captures:
            if len(inputs) == len(capture.metas) and all(isinstance(t, torch.Tensor) for t in inputs):
                reason = capture.matches(inputs, grad)
            else:
                _check_tensors(inputs, "opfuse.graphed")
                reason = mismatch(capture.metas, [TensorMeta.of(t) for t in inputs], check_grad=False)
            if reason is None:
                return capture
            reasons.append((capture, reason))
        _check_tensors(inputs, "opfuse.graphed")
        if self.recapture:
            capture = self._capture(inputs, self._wants_backward(inputs))
            self.captures.insert(0, capture)
            return capture
        received = describe_all([TensorMeta.of(t) for t in inputs])
        capture, reason = reasons[0]
        more = f" ({len(self.captures)} signatures captured)" if len(self.captures) > 1 else ""
        raise GraphSignatureError(
            f"opfuse.graphed({type(self.module).__name__}): {reason}. Captured signature{more}: "
            f"{describe_all(capture.metas)}; received: {received}. Pass inputs of a captured signature, or build "
            f"with opfuse.graphed(..., recapture=True) to record a graph per signature.")

    def _wants_backward(self, inputs) -> bool:
        if self.backward_mode is not None:
            return self.backward_mode
        return torch.is_grad_enabled() and (any(t.requires_grad for t in inputs)
                                            or any(p.requires_grad for p in self.module.parameters()))

    # Recording -------------------------------------------------------------------------------------

    def _capture(self, samples, training: bool) -> Capture:
        who = f"opfuse.graphed({type(self.module).__name__})"
        params = tuple(self.module.parameters())
        if training and not (any(t.requires_grad for t in samples) or any(p.requires_grad for p in params)):
            raise OpInputError(f"{who}: backward=True, but no input or parameter requires grad")
        device = samples[0].device
        if torch.is_autocast_enabled(device.type):
            raise OpInputError(f"{who}: autocast is enabled; opfuse ops take explicit dtypes, capture without it")
        if self.replay == "cuda_graph":
            for index, t in enumerate(list(samples) + list(params)):
                what = f"input {index}" if index < len(samples) else f"parameter {index - len(samples)}"
                if t.device.type != "cuda":
                    raise OpInputError(f"{who}: {what} is on {t.device}; CUDA graphs need CUDA tensors "
                                       f"(replay='eager' runs anywhere)")
                if t.device != device:
                    raise OpInputError(f"{who}: {what} is on {t.device}, input 0 on {device}; use one device")
            if device.index != torch.cuda.current_device():
                raise OpInputError(f"{who}: inputs are on {device} but the current device is "
                                   f"cuda:{torch.cuda.current_device()}; call torch.cuda.set_device first")
        with torch.inference_mode(False), torch.no_grad():
            static_inputs = tuple(t.detach().clone(memory_format=torch.contiguous_format) for t in samples)
        static_inputs = tuple(s.requires_grad_(training and t.requires_grad)
                              for s, t in zip(static_inputs, samples))
        metas = tuple(TensorMeta.of(t) for t in static_inputs)
        surface = static_inputs + params
        wants = [training and t.requires_grad for t in surface]
        replayer = make_replayer(self.replay, device, self.pool)
        grad_mode = torch.enable_grad if training else torch.no_grad
        spec = []

        def forward_body():
            flat, out_spec = pytree.tree_flatten(self.module(*static_inputs))
            for index, value in enumerate(flat):
                if not isinstance(value, torch.Tensor):
                    raise GraphCaptureError(f"{who}: output {index} is a {type(value).__name__}; graphed blocks "
                                            f"must return tensors")
            spec[:] = [out_spec]
            return flat

        def backward_body(outputs, grad_outputs, retain):
            pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None]
            wrt = [t for t, w in zip(surface, wants) if w]
            grads = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], retain_graph=retain,
                                             allow_unused=True))
            return [next(grads) if w else None for w in wants]

        def step():
            with grad_mode():
                outputs = forward_body()
                if training:
                    grads = [torch.ones_like(o) if o.requires_grad else None for o in outputs]
                    if any(g is not None for g in grads):
                        backward_body(outputs, grads, False)

        replayer.warmup(step, self.warmup)
        before = _program_keys(self.module)
        try:
            with grad_mode():
                static_outputs = replayer.capture_forward(forward_body)
        except GraphCaptureError:
            raise
        except Exception as error:
            raise GraphCaptureError(f"{who}: capturing the forward for inputs {describe_all(metas)} failed: "
                                    f"{type(error).__name__}: {error}") from error
        if replayer.strict_programs and _program_keys(self.module) != before:
            raise GraphCaptureError(
                f"{who}: a program was compiled during capture (its capability checks saw a capture in progress and "
                f"may have chosen fallbacks): the warm-up did not leave the program the capture ran in the cache. "
                f"Something changed between warm-up and capture (opfuse.config, the block, rules), or the compile "
                f"cache key is unstable (an opfuse bug). Inputs: {describe_all(metas)}.")
        differentiable = tuple(training and o.requires_grad for o in replayer.autograd_outputs())
        grad_outputs = tuple(torch.empty_like(o) if d else None for o, d in zip(static_outputs, differentiable))
        grads = [None] * len(surface)
        if training and any(differentiable):
            retain = self.replay == "eager"
            try:
                grads = replayer.capture_backward(
                    lambda: backward_body(replayer.autograd_outputs(), grad_outputs, retain))
            except Exception as error:
                raise GraphCaptureError(f"{who}: capturing the backward for inputs {describe_all(metas)} failed: "
                                        f"{type(error).__name__}: {error}") from error
        return Capture(
            metas=metas, training=training and any(differentiable), replayer=replayer,
            static_inputs=static_inputs, static_outputs=tuple(static_outputs), out_spec=spec[0],
            differentiable=differentiable, static_grad_outputs=grad_outputs, params=params,
            param_storage=tuple(p.detach() for p in params), param_ptrs=tuple(p.data_ptr() for p in params),
            param_requires_grad=tuple(p.requires_grad for p in params),
            input_grads=tuple(grads[:len(static_inputs)]), param_grads=tuple(grads[len(static_inputs):]),
            programs=tuple(_programs(self.module)))

    # Introspection ------------------------------------------------------------------------------------

    @property
    def static_inputs(self) -> tuple:
        """The most recent capture's input buffers: write into them and call with them to skip the copy."""
        return self.captures[0].static_inputs

    def extra_repr(self) -> str:
        signatures = "; ".join(describe_all(c.metas) + (" +backward" if c.training else "") for c in self.captures)
        return f"replay={self.replay!r}, captured=[{signatures}]"


def graphed(module: nn.Module, *sample_inputs: torch.Tensor, backward: Optional[bool] = None,
            clone_outputs: bool = False, recapture: bool = False, warmup: int = 3, pool=None,
            replay: str = "cuda_graph") -> GraphedModule:
    """Record ``module(*sample_inputs)`` as CUDA graphs and return a module that replays them.

    Parameters
    ----------
    module:
        The block: an ``opfuse.ops.Sequential`` (or any ``nn.Module`` of tensors in, tensors out).
    sample_inputs:
        Tensors of the signature to record (their values are used for the warm-up runs).
    backward:
        Record a backward graph too. ``None`` (default): when gradients are enabled and an input
        or a parameter requires grad. ``False``: forward only (call the result under
        ``torch.no_grad()``).
    clone_outputs:
        Return clones instead of the static output tensors (which the next call overwrites).
    recapture:
        On a call with another signature, record a graph for it instead of raising
        :class:`GraphSignatureError` (collective: every rank must do the same).
    warmup:
        Eager runs before capture (>= 1; the first compiles the program).
    pool:
        A ``torch.cuda.graph_pool_handle()`` to share with other captures (capture and replay
        them in the same order); default: a private pool per signature.
    replay:
        ``"cuda_graph"``, or ``"eager"``: re-run the block on each call with the same buffer
        semantics (debugging; works on CPU).

    Examples
    --------
    >>> block = build_block(8192, 28672, dtype=torch.bfloat16, device="cuda")  # doctest: +SKIP
    >>> with torch.no_grad():                                                   # doctest: +SKIP
    ...     step = opfuse.graphed(block, x, residual)         # forward-only decode graph
    ...     y, residual = step(x_next, residual_next)         # copies inputs, replays
    >>> train = opfuse.graphed(block, x.requires_grad_(), residual)  # doctest: +SKIP
    >>> y, h = train(x, residual); (y.float().square().sum() + h.sum()).backward()  # doctest: +SKIP
    """
    who = "opfuse.graphed"
    if not isinstance(module, nn.Module):
        raise TypeError(f"{who}: expected an nn.Module (an opfuse.ops.Sequential), got {type(module).__name__}")
    _check_tensors(sample_inputs, who)
    if replay not in REPLAY_MODES:
        raise ValueError(f"{who}: replay={replay!r}; accepted: {', '.join(map(repr, REPLAY_MODES))}")
    if backward not in (None, True, False):
        raise ValueError(f"{who}: backward={backward!r}; accepted: None (automatic), True, False")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"{who}: warmup={warmup!r}; expected an int >= 1 (the first run compiles the program)")
    if replay == "cuda_graph" and not torch.cuda.is_available():
        raise OpInputError(f"{who}: CUDA graphs need a CUDA device, and none is available (replay='eager' runs "
                           f"anywhere)")
    if isinstance(module, Sequential):
        module.check_inputs(sample_inputs)
    result = GraphedModule(module, backward=backward, clone_outputs=clone_outputs, recapture=recapture,
                           warmup=warmup, pool=pool, replay=replay)
    result.captures.append(result._capture(sample_inputs, result._wants_backward(sample_inputs)))
    return result
