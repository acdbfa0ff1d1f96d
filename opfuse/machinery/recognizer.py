"""Recognizers: functions that find the aten nodes standing for one opfuse op (a :class:`~.region.Region`)
in the graphs torch.compile hands the backend, and the order they run in.

A recognizer is ``fn(node, found) -> Region | list[Region] | None``: called on every node of the
graph, it returns the region anchored there, if any. ``found`` answers what earlier recognizers
claimed (``found.kind_of(node)``: the kind of the op whose value ``node`` holds). A list is claimed
all or nothing (the GEMM and bias halves of an ``addmm``).

Order. Recognizers run phase by phase (:class:`Phase`, lowest first); within a phase every node is
visited in graph order and the phase's recognizers are tried on it in registration order, the first
region wins. Each aten node belongs to at most one region: a region that overlaps one already
claimed, or whose interior values used outside it would recompute a GEMM or a collective, is
dropped. The phases put first the ops whose aten forms contain other ops' forms (a gated activation
contains an activation, a norm contains multiplies and adds), so that the larger form is claimed
whole.

:class:`RecognizerRegistry` is the one registry API (:mod:`.registry`); the process-wide one, with
the torch.compile front end's recognizers and the families', is
:mod:`opfuse.torch_compile.recognition`.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from typing import Callable, Iterable

from torch import fx

from .region import Region, recompute_closure
from .registry import Registry
from .rule import caller_location

__all__ = ["Phase", "Recognizer", "RecognizerError", "RecognizerRegistry", "Found", "find_regions"]


class Phase(enum.IntEnum):
    """When a recognizer runs (lowest first)."""

    #: Forms that contain another op's form: ``act(gate) * up`` contains ``act``.
    COMPOSITE = 10
    #: Norms and activations: they own the multiplies and adds the later phases would take.
    NORMS_AND_ACTIVATIONS = 20
    #: ``_c10d_functional`` collectives and their waits.
    COLLECTIVES = 30
    #: GEMMs (``mm``, ``addmm``, ``_grouped_mm``) with a weight that is a graph input.
    GEMMS = 40
    #: Biases and residual adds (which operand is the main input depends on the ops found before).
    ADDS = 50


class RecognizerError(ValueError):
    """A malformed recognizer (at registration)."""


@dataclasses.dataclass(frozen=True)
class Recognizer:
    """A recognizer: ``name``, ``phase`` (:class:`Phase` or an int), ``fn(node, found)``, a one-line
    ``description`` and where it was defined (``source``, filled in)."""

    name: str
    phase: int
    fn: Callable[[fx.Node, "Found"], Region | list[Region] | None]
    description: str = ""
    source: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.replace("-", "_").isidentifier():
            raise RecognizerError(f"Recognizer: name={self.name!r}; expected a non-empty identifier-like string")
        if not isinstance(self.phase, int) or isinstance(self.phase, bool):
            raise RecognizerError(f"Recognizer {self.name!r}: phase={self.phase!r}; expected an int or an "
                                  f"opfuse.machinery.recognizer.Phase ({', '.join(p.name for p in Phase)})")
        if not callable(self.fn):
            raise RecognizerError(f"Recognizer {self.name!r}: fn={self.fn!r} is not callable")
        try:
            inspect.signature(self.fn).bind(None, None)
        except TypeError:
            raise RecognizerError(f"Recognizer {self.name!r}: fn must take (node, found); got signature "
                                  f"{inspect.signature(self.fn)}") from None
        except ValueError:  # builtins without a signature
            pass
        if not self.source:
            object.__setattr__(self, "source", caller_location(2))

    def __repr__(self) -> str:
        return f"Recognizer({self.name!r}, phase={self.phase}, at {self.source})"


class RecognizerRegistry(Registry[Recognizer]):
    """The recognizers in the order they run: by phase, then registration order."""

    kind = "recognizer"
    plural = "recognizers"
    error = RecognizerError
    api_module = "opfuse.torch_compile"

    def _validate(self, recognizer: Recognizer) -> None:
        if not isinstance(recognizer, Recognizer):
            raise RecognizerError(f"register_recognizer: expected a Recognizer, got {type(recognizer).__name__}")

    def _order(self, recognizers: list[Recognizer]) -> list[Recognizer]:
        order = {name: i for i, name in enumerate(self._entries)}
        return sorted(recognizers, key=lambda r: (r.phase, order[r.name]))


class Found:
    """What the recognizers of earlier phases claimed (what a recognizer's ``found`` argument
    answers; within a phase the answers do not change, so a phase's result does not depend on the
    order of its nodes' claims)."""

    def __init__(self):
        self.regions: list[Region] = []
        self.taken: set[fx.Node] = set()
        self._kinds: dict[fx.Node, str] = {}
        self._by_value: dict[fx.Node, Region] = {}

    def kind_of(self, node) -> str | None:
        """The kind of the op whose value ``node`` holds, if a recognizer of an earlier phase claimed it."""
        return self._kinds.get(node)

    def region_of(self, node) -> Region | None:
        """The region whose value ``node`` holds, among every region claimed so far, this phase's
        included: nodes are visited in graph order, so a value's producer is claimed before its
        users look (a bias added after an all-reduce is a Bias when the residual add reads it)."""
        return self._by_value.get(node)

    def _next_phase(self) -> None:
        self._kinds = {r.value: r.kind for r in self.regions if r.value is not None}

    def _claim(self, regions: list[Region], check_valueless: bool) -> None:
        if any(region.nodes & self.taken for region in regions):
            return
        for region in regions:
            if (check_valueless or region.value is not None) and recompute_closure(region) is None:
                return
        for region in regions:
            self.taken.update(region.nodes)
            self.regions.append(region)
            if region.value is not None:
                self._by_value[region.value] = region


def find_regions(graph: fx.Graph, recognizers: Iterable[Recognizer], exclude=frozenset()) -> list[Region]:
    """Every region the ``recognizers`` find in ``graph`` (see the module docstring), in graph order of
    their results; each aten node belongs to at most one region, and none to ``exclude``."""
    nodes = list(graph.nodes)
    found = Found()
    found.taken.update(exclude)
    by_phase: dict[int, list[Recognizer]] = {}
    for recognizer in recognizers:
        by_phase.setdefault(recognizer.phase, []).append(recognizer)
    for phase in sorted(by_phase):
        found._next_phase()
        for node in nodes:
            for recognizer in by_phase[phase]:
                result = recognizer.fn(node, found)
                if result:
                    # A single region may stand without a value of its own only as half of a list
                    # (the GEMM of an addmm): a list is checked whole.
                    found._claim(result if isinstance(result, list) else [result], isinstance(result, list))
                    break
    order = {node: i for i, node in enumerate(nodes)}
    return sorted(found.regions, key=lambda r: (order[r.position], r.virtual_input))
