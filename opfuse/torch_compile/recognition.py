"""Raising an aten graph: every region that stands for an opfuse op, found by the process-wide
recognizers; each aten node belongs to at most one region.

The recognizers are the front end's own (:data:`.recognizers.BASIC_RECOGNIZERS`: collectives,
GEMMs, biases, residual adds), every family's (``families/<family>/recognizers.py``, in the order
of :data:`opfuse.families.FAMILIES`: norms, GELU, gated activations, grouped GEMMs), and those users
register (:func:`register_recognizer`); how they run, phase by phase, is
:mod:`opfuse.machinery.recognizer`. A rule over an op with a recognizer fires on torch.compile
graphs as it does on ``ops.Sequential`` blocks.
"""

from __future__ import annotations

from typing import Callable

from torch import fx

from ..families import FAMILIES
from ..machinery.recognizer import Found, Phase, Recognizer, RecognizerRegistry
from ..machinery.recognizer import find_regions as run_recognizers
from ..machinery.region import Region
from ..machinery.rule import caller_location
from .recognizers import BASIC_RECOGNIZERS

__all__ = ["find_regions", "register_recognizer", "remove_recognizer", "recognizers", "disabled_recognizers",
           "get_recognizer_registry", "BUILTIN_RECOGNIZERS"]

#: Every built-in recognizer: the families' (in the order of the family list), then the front end's.
BUILTIN_RECOGNIZERS: tuple[Recognizer, ...] = (
    *(recognizer for family in FAMILIES for recognizer in family.recognizers), *BASIC_RECOGNIZERS)

_REGISTRY = RecognizerRegistry(BUILTIN_RECOGNIZERS)


def get_recognizer_registry() -> RecognizerRegistry:
    """The process-wide recognizer registry."""
    return _REGISTRY


def register_recognizer(fn: Callable[[fx.Node, Found], Region | list[Region] | None] | None = None, *, name: str,
                        phase: int = Phase.NORMS_AND_ACTIVATIONS, description: str = "", replace: bool = False):
    """Register ``fn(node, found) -> Region | None``, which finds an opfuse op in the aten graphs
    torch.compile hands opfuse (also a decorator). ``phase`` says when it runs
    (:class:`~opfuse.machinery.recognizer.Phase`); rules over the op it returns then fire under
    torch.compile. Returns ``fn``.

    Examples
    --------
    >>> @register_recognizer(name="my_scale", phase=Phase.NORMS_AND_ACTIVATIONS)   # doctest: +SKIP
    ... def my_scale(node, found):
    ...     if calls(node, aten.mul.Tensor) and node.args[1] == 3.0:
    ...         return Region(frozen(Scale(3.0)), (node.args[0],), node, frozenset({node}))
    """
    source = caller_location(1)

    def finish(function):
        _REGISTRY.add(Recognizer(name, int(phase), function, description or (function.__doc__ or "").strip()
                                 .split("\n")[0], source=source), replace=replace)
        return function

    return finish if fn is None else finish(fn)


def remove_recognizer(name: str) -> Recognizer:
    """Unregister the recognizer called ``name`` and return it."""
    return _REGISTRY.remove(name)


def recognizers() -> list[Recognizer]:
    """Every recognizer, in the order they run."""
    return _REGISTRY.ordered()


def disabled_recognizers(*names: str):
    """Context manager: the recognizers ``names`` do not run inside the block (graphs compiled
    there keep those ops' aten nodes as they are)."""
    return _REGISTRY.disabled(*names)


def find_regions(graph: fx.Graph, exclude=frozenset()) -> list[Region]:
    """Every region of ``graph``, in graph order of their results; each aten node belongs to at
    most one region (the ``addmm`` pair shares its node); none holds a node of ``exclude`` (values
    that stay as they are, e.g. collectives left to NCCL)."""
    return run_recognizers(graph, _REGISTRY.active(), exclude)
