"""The torch.compile front end: opfuse's rules applied to the graphs torch.compile captures from
ordinary models (``torch.compile(model, backend="opfuse")``, :func:`optimize`, :func:`programs`).

Modules, in the order a compile goes through them: :mod:`.backend` (the backend, ``optimize``,
``programs``), :mod:`.graph_pass` (the Inductor pass that does all of it), :mod:`.recognition`
(the recognizers: this front end's, :mod:`.recognizers`, and the families'; users add theirs with
:func:`register_recognizer`), :mod:`.op_graph` (the op graph the core's pass pipeline runs on),
:mod:`.lower` (fused ops back to custom-op calls), :mod:`.program` (what it did, per graph). The
pipeline, rules, dispatch and ``Program`` are the core's (:mod:`opfuse.core`), shared with the
``ops.Sequential`` front end (:mod:`opfuse.sequential`), which this package never imports.

FP8, MoE and merged projections (issue 27): :mod:`.fp8` (the FP8 plan of a graph: which GEMMs,
the filter), :mod:`.fp8_backward` (the backward GEMMs of a linear in the joint graph),
:mod:`.fp8_lower` (FP8 activations as two plain values, FP8 backward GEMMs, grouped backward),
:mod:`.fp8_ops` (the custom ops carrying them), :mod:`.inputs` (which parameter a graph input is),
:mod:`.prepare` / :mod:`.moe` / :mod:`.merge_projections` (model rewrites before compiling),
:mod:`.joins` (concatenations of adjacent inputs as views), :mod:`.layout_guard` (checking the
layout such views rely on).
"""

from ..machinery.recognizer import Phase, Recognizer
from .backend import OpfuseBackend, opfuse_backend, optimize, programs, register
from .layout_guard import LayoutChanged
from .prepare import Prepared, prepare_model
from .recognition import disabled_recognizers, recognizers, register_recognizer, remove_recognizer

__all__ = ["OpfuseBackend", "opfuse_backend", "optimize", "programs", "register", "register_recognizer",
           "remove_recognizer", "recognizers", "disabled_recognizers", "Phase", "Recognizer", "prepare_model",
           "Prepared", "LayoutChanged"]
