"""The torch.compile front end: opfuse's rules applied to the graphs torch.compile captures from
ordinary models (``torch.compile(model, backend="opfuse")``, :func:`optimize`, :func:`programs`).

Modules, one job each: :mod:`.aten` (questions about aten nodes), :mod:`.regions` (recognising
opfuse ops in aten graphs), :mod:`.op_graph` (the op graph the pass pipeline runs on),
:mod:`.lower` (fused ops back to custom-op calls), :mod:`.graph_pass` (the Inductor pass that
does all of it), :mod:`.program` (what it did, per graph), :mod:`.backend` (the backend).
"""

from .backend import OpfuseBackend, opfuse_backend, optimize, programs, register
from .layout_guard import LayoutChanged
from .prepare import Prepared, prepare_model

__all__ = ["OpfuseBackend", "opfuse_backend", "optimize", "programs", "register", "prepare_model", "Prepared",
           "LayoutChanged"]
