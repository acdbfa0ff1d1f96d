"""Lowering ``ops.Sequential`` to torch.fx, the compile cache, and the ``Program`` object."""

from .compile import compile
from .program import Program

__all__ = ["compile", "Program"]
