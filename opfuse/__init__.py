"""opfuse: op fusion for tensor-parallel transformer blocks in PyTorch.

Declare a block as ``opfuse.ops.Sequential(...)``; on first call opfuse lowers it to a torch.fx
graph, inserts the collectives its tensor parallelism needs, fuses patterns such as
all-reduce -> add -> RMSNorm into single implementations, and caches the result as a
:class:`Program` (see :func:`compile`).
"""

from . import fp8, ops, passes
from .checkpoint import load_unsharded_state_dict, unsharded_state_dict
from .config import config  # the settings object (shadows the module name on purpose)
from .fuser import Program, compile
from .graphs import graphed
from .ops.collectives import sync_sequence_parallel_grads

__version__ = "0.1.0"

__all__ = ["ops", "passes", "fp8", "config", "compile", "graphed", "Program", "sync_sequence_parallel_grads",
           "unsharded_state_dict", "load_unsharded_state_dict", "__version__"]
