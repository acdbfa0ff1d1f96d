"""Fusible ops: each an ``nn.Module`` with a pure-torch reference forward and backward, and a rule
for how it transforms a tensor-parallel layout.

Compose them with :class:`Sequential` (defined with the compiler, :mod:`opfuse.sequential.block`,
and named here); opfuse lowers, partitions and fuses the chain.
"""

from .activation import GELU, GatedActivation, SwiGLU
from .base import BasicOp, OpInputError, PartitionError, TensorMeta
from .collectives import AllGather, AllReduce, GradAllReduce, ReduceScatter, SplitFeatures, TokensToFeatures
from .extra import AddExtraInput, Identity, MakeExtraOutput
from .gated import GatedLinear
from .grouped import BasicGroupedLinear, GroupedLinear
from .linear import BasicLinear, Bias, Linear
from .norm import ExtraOutputNorm, LayerNorm, RMSNorm
from .quantize import Quantize
from .sharding import Sharding

__all__ = [
    "AddExtraInput",
    "AllGather",
    "AllReduce",
    "BasicGroupedLinear",
    "BasicLinear",
    "BasicOp",
    "Bias",
    "ExtraOutputNorm",
    "GELU",
    "GatedActivation",
    "GatedLinear",
    "GradAllReduce",
    "GroupedLinear",
    "Identity",
    "LayerNorm",
    "Linear",
    "MakeExtraOutput",
    "OpInputError",
    "PartitionError",
    "Quantize",
    "RMSNorm",
    "ReduceScatter",
    "Sequential",
    "Sharding",
    "SplitFeatures",
    "SwiGLU",
    "TensorMeta",
    "TokensToFeatures",
]


def __getattr__(name):
    # Sequential compiles itself, so it lives above the ops (in the sequential front end); importing it lazily
    # keeps this package free of the compiler.
    if name == "Sequential":
        from ..sequential.block import Sequential

        return Sequential
    raise AttributeError(f"module 'opfuse.ops' has no attribute {name!r}")
