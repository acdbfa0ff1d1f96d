"""Fusible ops: each an ``nn.Module`` with a pure-torch reference forward and backward.

Compose them with :class:`Sequential`; opfuse lowers, partitions and fuses the chain.
"""

from .activation import GELU, SwiGLU
from .base import BasicOp, OpInputError, TensorMeta
from .collectives import AllGather, AllReduce, GradAllReduce, ReduceScatter, SplitFeatures
from .extra import AddExtraInput, Identity, MakeExtraOutput
from .grouped import BasicGroupedLinear, GroupedLinear
from .linear import BasicLinear, Bias, Linear
from .norm import LayerNorm, RMSNorm
from .sequential import Sequential
from .sharding import Sharding

__all__ = [
    "AddExtraInput",
    "AllGather",
    "AllReduce",
    "BasicGroupedLinear",
    "BasicLinear",
    "BasicOp",
    "Bias",
    "GELU",
    "GradAllReduce",
    "GroupedLinear",
    "Identity",
    "LayerNorm",
    "Linear",
    "MakeExtraOutput",
    "OpInputError",
    "RMSNorm",
    "ReduceScatter",
    "Sequential",
    "Sharding",
    "SplitFeatures",
    "SwiGLU",
    "TensorMeta",
]
