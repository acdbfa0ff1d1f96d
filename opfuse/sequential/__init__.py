"""Compiling blocks: ``Sequential`` (the compiled block), lowering to torch.fx, the compile cache, and
the ``Program`` object."""

from ..core.program import Program
from .block import Sequential, compile

__all__ = ["compile", "Program", "Sequential"]
