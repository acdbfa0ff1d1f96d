"""Compiling a block: lower, run the pass pipeline, and cache programs per input signature
(the public entry point is :func:`opfuse.fuser.sequential.compile`)."""

from __future__ import annotations

import itertools
import os

import torch
from torch import fx

from .. import log
from ..config import config, version
from ..debug.dump import render_python, render_text
from ..fp8.state import current_recipe
from ..ops.base import TensorMeta, structure_version
from ..passes.pipeline import PassContext, run_pipeline
from ..passes.registry import generation
from .lower import lower
from .program import Program

__all__ = ["cached_program", "build_program", "signature", "PassRecorder", "new_dump_dir"]

_program_ids = itertools.count()


def signature(seq, inputs) -> tuple:
    """Everything a compiled program depends on besides the block's structure."""
    shapes = tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in inputs)
    return (shapes, seq.requires_grad_key(), torch.is_grad_enabled(), version(), generation(), structure_version(),
            current_recipe())


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
    """A fresh directory under ``OPFUSE_DUMP`` for one program (``None`` when dumping is off)."""
    if not config.dump_dir:
        return None
    path = os.path.join(config.dump_dir, f"{_rank_tag()}{label}{next(_program_ids)}")
    os.makedirs(path, exist_ok=True)
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
    metas = [TensorMeta.of(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    gm = lower(seq, metas)
    ctx = PassContext(recipe=current_recipe())
    recorder = PassRecorder(ctx, new_dump_dir())
    run_pipeline(gm, ctx, recorder)
    program = Program(seq, gm, ctx.unfused, ctx.fusions, metas, notes=ctx.notes)
    recorder.write_explanation(program)
    return program


def cached_program(seq, inputs) -> Program:
    key = signature(seq, inputs)
    program = seq._programs.get(key)
    if program is None:
        if seq._programs:
            log.recompile(type(seq).__name__, f"a new input signature, setting, rule set or structure "
                                              f"({len(seq._programs)} program(s) cached)")
        program = build_program(seq, inputs)
        seq._programs[key] = program
    return program
