"""The ``ops.Sequential`` front end: a block of basic ops compiled on first call.

Modules, in the order a call goes through them: :mod:`.block` (``Sequential`` and
``opfuse.compile``), :mod:`.cache` (the compile cache: what a program depends on, and building one),
:mod:`.lower` (the block as an op graph, every value annotated), :mod:`.agree` (every rank of a
group compiles the same program), :mod:`.diagnose` (a clear error when a changed block fails).
The pipeline, ``Program``, dumps and dispatch it calls are the core's (:mod:`opfuse.core`), shared
with the torch.compile front end (:mod:`opfuse.torch_compile`), which this package never imports.
"""

from .block import Sequential, compile

__all__ = ["compile", "Sequential"]
