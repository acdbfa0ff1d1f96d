"""What both front ends record while a program compiles: the unfused graph (a copy after
partitioning, for ``Program.dump(graph="unfused")`` and ``explain()``) and, with ``OPFUSE_DUMP``,
every graph after each pass, written to one fresh directory per program."""

from __future__ import annotations

import itertools
import os

import torch
from torch import fx

from ..config import config, env_name
from ..debug.dump import render_python, render_text
from ..machinery.context import PassContext
from .program import Program

__all__ = ["DumpError", "PassRecorder", "new_dump_dir"]

_program_ids = itertools.count()


class DumpError(OSError):
    """``OPFUSE_DUMP`` / ``opfuse.config.dump_dir`` names a directory that cannot be written."""


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
