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

__all__ = ["cached_program", "build_program", "signature"]

_program_ids = itertools.count()


def signature(seq, inputs) -> tuple:
    """Everything a compiled program depends on besides the block's structure."""
    shapes = tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in inputs)
    return (shapes, seq.requires_grad_key(), torch.is_grad_enabled(), version(), generation(), structure_version(),
            current_recipe())


def _light_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the graph that shares (does not copy) the submodules and their parameters."""
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    modules = {n.target: gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    return fx.GraphModule(modules, graph, class_name="OpfuseProgram")


def _rank_tag() -> str:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return f"rank{torch.distributed.get_rank()}_"
    return ""


def build_program(seq, inputs) -> Program:
    metas = [TensorMeta.of(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    gm = lower(seq, metas)
    ctx = PassContext(recipe=current_recipe())
    dump_dir = None
    if config.dump_dir:
        dump_dir = os.path.join(config.dump_dir, f"{_rank_tag()}program{next(_program_ids)}")
        os.makedirs(dump_dir, exist_ok=True)
    steps = itertools.count()

    def after_pass(name: str, module: fx.GraphModule) -> None:
        if name == "partition":  # the unfused program: partitioned (FP8 GEMMs marked under autocast)
            ctx.unfused = _light_copy(module)
        if dump_dir is not None:
            stem = os.path.join(dump_dir, f"{next(steps):02d}_{name}")
            title = f"after pass {name}"
            with open(stem + ".py", "w") as handle:
                handle.write(render_python(module, title))
            with open(stem + ".txt", "w") as handle:
                handle.write(render_text(module, title))

    run_pipeline(gm, ctx, after_pass)
    program = Program(seq, gm, ctx.unfused, ctx.fusions, metas, notes=ctx.notes)
    if dump_dir is not None:
        with open(os.path.join(dump_dir, "explain.txt"), "w") as handle:
            handle.write(program.explain())
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
