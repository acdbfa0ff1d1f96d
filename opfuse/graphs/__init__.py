"""Blocks as CUDA graphs: :func:`graphed` records a block's forward and backward once and replays
them (:mod:`.graphed`: the module and its rules; :mod:`.recording`: one recorded signature and the
autograd function that replays it; :mod:`.recorders`: how a recording is made, CUDA graphs or an
eager stand-in)."""

from .graphed import GraphCaptureError, GraphedModule, GraphSignatureError, graphed

__all__ = ["graphed", "GraphedModule", "GraphSignatureError", "GraphCaptureError"]
