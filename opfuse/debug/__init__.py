"""Graph dumps (python / text / dot / html), ``explain``, and ``OPFUSE_DUMP``."""

from .dump import FORMATS, render

__all__ = ["FORMATS", "render"]
