"""The torch.compile front end: opfuse's rules applied to the graphs torch.compile captures from
ordinary models (``torch.compile(model, backend="opfuse")``, :func:`optimize`, :func:`programs`).

Modules, one job each: :mod:`.recognizers` / :mod:`.recognition` (recognising opfuse ops in aten
graphs), :mod:`.op_graph` (the op graph the pass pipeline runs on), :mod:`.lower` (fused ops back
to custom-op calls), :mod:`.graph_pass` (the Inductor pass that does all of it), :mod:`.program`
(what it did, per graph), :mod:`.backend` (the backend).

FP8, MoE and merged projections (issue 27): :mod:`.fp8` (the FP8 plan of a graph: which GEMMs,
the filter), :mod:`.fp8_backward` (the backward GEMMs of a linear in the joint graph),
:mod:`.fp8_lower` (FP8 activations as two plain values, FP8 backward GEMMs, grouped backward),
:mod:`.fp8_ops` (the custom ops carrying them), :mod:`.inputs` (which parameter a graph input is),
:mod:`.prepare` / :mod:`.moe` / :mod:`.merge_projections` (model rewrites before compiling),
:mod:`.joins` (concatenations of adjacent inputs as views), :mod:`.layout_guard` (checking the
layout such views rely on).
"""

from .backend import OpfuseBackend, opfuse_backend, optimize, programs, register
from .layout_guard import LayoutChanged
from .prepare import Prepared, prepare_model

__all__ = ["OpfuseBackend", "opfuse_backend", "optimize", "programs", "register", "prepare_model", "Prepared",
           "LayoutChanged"]
