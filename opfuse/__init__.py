"""opfuse: op fusion for tensor-parallel transformer blocks in PyTorch.

Declare a block as ``opfuse.ops.Sequential(...)``; on first call opfuse lowers it to a torch.fx
graph, inserts the collectives its tensor parallelism needs, fuses patterns such as
all-reduce -> add -> RMSNorm into single implementations, and caches the result as a
:class:`Program` (see :func:`compile`). The same rules apply to ordinary models through torch.compile:
``torch.compile(model, backend="opfuse")`` or :func:`optimize`; :func:`programs` lists what they
fused.
"""

from . import fp8, ops, passes
from .runtime.peer_watch import PeerTimeoutError, check_peers
from .checkpoint import load_unsharded_state_dict, unsharded_state_dict
from .config import config  # the settings object (shadows the module name on purpose)
from .core.program import Program
from .sequential import compile
from .graphs import graphed
from .ops.sequence_parallel import sync_sequence_parallel_grads
from .plugins import register_family, remove_family
from .torch_compile import optimize, programs
from .torch_compile import register as _register_backend

__version__ = "0.1.0"

__all__ = ["ops", "passes", "fp8", "config", "compile", "graphed", "optimize", "programs", "Program",
           "sync_sequence_parallel_grads", "unsharded_state_dict", "load_unsharded_state_dict", "check_peers",
           "PeerTimeoutError", "register_family", "remove_family", "__version__"]

_register_backend()  # backend="opfuse" for torch.compile (see opfuse.torch_compile.backend)
