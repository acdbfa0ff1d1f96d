"""Compiling a block: lower, run the pass pipeline, and cache programs.

The cache key has two parts:

* the block's *state* (:func:`state_key`): its structure, each op's version (bumped by any
  attribute assignment or dtype/device conversion of the op), the settings' values, the active
  rules and the pass pipeline. A change here makes every program of the block stale, so they are
  dropped;
* the *call* (:func:`call_key`): shape, dtype, device and ``requires_grad`` of each input,
  whether gradients are enabled, ``requires_grad`` of each parameter, and the FP8 recipe of the
  enclosing ``opfuse.fp8.autocast``.

Computing the state part costs tens of microseconds, so a block checks it only when
:mod:`opfuse.epoch` moved (any such change anywhere bumps it); per call it compares the call key
and one integer (``Sequential.forward``).
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist
from torch import fx

from ..config import config, env_name, snapshot
from ..debug.dump import render_python, render_text
from ..fp8.state import current_recipe
from ..ops.base import TensorMeta
from ..passes import pass_registry
from ..passes.pipeline import PassContext, run_pipeline
from ..passes.registry import active_key
from . import replicated
from .agree import Agreement, groups_of, signature_lines
from .lower import lower
from .program import Program

__all__ = ["state_key", "call_key", "build_program", "default_group", "uses_default_group", "DumpError", "PassRecorder",
           "new_dump_dir"]

_program_ids = itertools.count()


class DumpError(OSError):
    """``OPFUSE_DUMP`` / ``opfuse.config.dump_dir`` names a directory that cannot be written."""


def default_group():
    """The default process group, or ``None`` before ``init_process_group`` (ops built with
    ``group=None`` use it; a re-created one invalidates their programs)."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def state_key(seq) -> tuple:
    """What every program of ``seq`` depends on besides its inputs (see the module docstring)."""
    return (tuple(map(id, seq._modules.values())), tuple(op._op_version for op in seq), snapshot(), active_key(),
            pass_registry.generation(), id(default_group()))


def uses_default_group(seq) -> bool:
    return any(group is None for op in seq for group in op.process_groups())


def call_key(inputs, params) -> tuple:
    """What a program depends on in one call (see the module docstring); ``Sequential.forward``
    computes the same tuple inline."""
    return (tuple([(t.shape, t.dtype, t.device, t.requires_grad) for t in inputs]), torch.is_grad_enabled(),
            tuple([p.requires_grad for p in params]), current_recipe())


def _light_copy(gm: fx.GraphModule, cls=fx.GraphModule) -> fx.GraphModule:
    """A copy of the graph that shares (does not copy) the submodules and their parameters."""
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    modules = {n.target: gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    return cls(modules, graph, class_name="OpfuseProgram")


def _rank_tag() -> str:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return f"rank{torch.distributed.get_rank()}_"
    return ""


def new_dump_dir(label: str = "program") -> str | None:
    """A fresh directory under ``OPFUSE_DUMP`` for one program (``None`` when dumping is off);
    :class:`DumpError` naming the setting when it cannot be written."""
    if not config.dump_dir:
        return None
    path = os.path.join(config.dump_dir, f"{_rank_tag()}{label}{next(_program_ids)}")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".opfuse_write_test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        raise DumpError(f"{env_name('dump_dir')} / opfuse.config.dump_dir={config.dump_dir!r}: cannot write the "
                        f"program dumps to {path!r} ({error.strerror or error}); point it to a writable "
                        f"directory or set it to '' to disable dumping") from error
    return path


class PassRecorder:
    """The pipeline's ``after_pass`` callback: keeps the unfused graph (a copy after partitioning,
    a ``module_class``) in the pass context and writes every graph to ``dump_dir``
    (``NN_<pass>.py`` / ``.txt``)."""

    def __init__(self, ctx: PassContext, dump_dir: str | None, module_class=fx.GraphModule):
        self.ctx = ctx
        self.dump_dir = dump_dir
        self.module_class = module_class
        self._steps = itertools.count()

    def __call__(self, name: str, module: fx.GraphModule) -> None:
        if name == "partition":
            self.ctx.unfused = _light_copy(module, self.module_class)
        if self.dump_dir is not None:
            self.write(f"{next(self._steps):02d}_{name}", module, f"after pass {name}")

    def write(self, stem: str, module: fx.GraphModule, title: str) -> None:
        path = os.path.join(self.dump_dir, stem)
        with open(path + ".py", "w") as handle:
            handle.write(render_python(module, title))
        with open(path + ".txt", "w") as handle:
            handle.write(render_text(module, title))

    def write_explanation(self, program: Program) -> None:
        if self.dump_dir is not None:
            with open(os.path.join(self.dump_dir, "explain.txt"), "w") as handle:
                handle.write(program.explain())


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
