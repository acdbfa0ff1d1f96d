"""Compiling blocks: ``Sequential`` (the compiled block), lowering to torch.fx, the compile cache, and
the ``Program`` object."""

from .program import Program
from .sequential import Sequential, compile

__all__ = ["compile", "Program", "Sequential"]
