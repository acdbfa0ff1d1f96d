"""Compiling a block: lower, run the pass pipeline, and cache programs.

The cache key has two parts:

* the block's *state* (:func:`state_key`): its structure, each op's version (bumped by any
  attribute assignment or dtype/device conversion of the op), the settings' values, the active
  rules, the pass pipeline and the registered implementations. A change here makes every program of the block stale, so they are
  dropped;
* the *call* (:func:`call_key`): shape, dtype, device and ``requires_grad`` of each input,
  whether gradients are enabled, ``requires_grad`` of each parameter, and the FP8 recipe of the
  enclosing ``opfuse.fp8.autocast``.

Computing the state part costs tens of microseconds, so a block checks it only when
:mod:`opfuse.epoch` moved (any such change anywhere bumps it); per call it compares the call key
and one integer (``Sequential.forward``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import fx

from ..config import config, snapshot
from ..fp8.state import current_recipe
from ..ops.base import TensorMeta
from ..machinery import graph_pass as pass_registry
from ..core import dispatch
from ..core.pipeline import PassContext, run_pipeline
from ..core.rules import active_key
from . import replicated
from .agree import Agreement, groups_of, signature_lines
from .lower import lower
from ..core.program import Program
from ..core.recorder import PassRecorder, new_dump_dir

__all__ = ["state_key", "call_key", "build_program", "default_group", "uses_default_group"]


def default_group():
    """The default process group, or ``None`` before ``init_process_group`` (ops built with
    ``group=None`` use it; a re-created one invalidates their programs)."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def state_key(seq) -> tuple:
    """What every program of ``seq`` depends on besides its inputs (see the module docstring)."""
    return (tuple(map(id, seq._modules.values())), tuple(op._op_version for op in seq), snapshot(), active_key(),
            pass_registry.generation(), dispatch.generation(), id(default_group()))


def uses_default_group(seq) -> bool:
    return any(group is None for op in seq for group in op.process_groups())


def call_key(inputs, params) -> tuple:
    """What a program depends on in one call (see the module docstring); ``Sequential.forward``
    computes the same tuple inline."""
    return (tuple([(t.shape, t.dtype, t.device, t.requires_grad) for t in inputs]), torch.is_grad_enabled(),
            tuple([p.requires_grad for p in params]), current_recipe())


def build_program(seq, inputs) -> Program:
    """Lower ``seq`` for ``inputs``, check that every rank of its groups compiles the same program
    (:mod:`.agree`), run the pass pipeline and wrap the result."""
    metas = [TensorMeta.of(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    recorder_dir = new_dump_dir()
    agreement = Agreement(groups_of(seq))
    ctx = PassContext(recipe=current_recipe())
    recorder = PassRecorder(ctx, recorder_dir)
    published = False
    call_checks: list = []

    def after_pass(name: str, module: fx.GraphModule) -> None:
        nonlocal published
        recorder(name, module)
        if name == "partition":
            # The partitioned graph has every collective; nothing has communicated yet.
            checked = replicated.inputs_to_check(module) if agreement.pgs and config.check_replicated != "off" else []
            values = replicated.digests(checked, inputs) if checked else None
            agreement.publish(signature_lines(module), checked=checked, values=values)
            published = True
            agreement.verify()
            if config.check_replicated == "always":
                call_checks.extend(checked)

    try:
        gm = lower(seq, metas)
        run_pipeline(gm, ctx, after_pass)
    except Exception as error:
        if not published:  # the other ranks fail at once instead of waiting for this one
            agreement.publish(error=error)
        raise
    program = Program(seq, gm, ctx.unfused, ctx.fusions, metas, notes=ctx.notes)
    if call_checks:
        pgs = agreement.pgs
        program.check_call = lambda call_inputs: replicated.check_call(call_checks, pgs, call_inputs)
    recorder.write_explanation(program)
    return program
