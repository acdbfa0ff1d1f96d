"""How a composite op's basic ops are wired: a chain, or a small graph.

``Linear.expand`` returns a chain (each basic op reads the previous one's output). A composite
whose basic ops branch, such as ``GatedLinear`` (two GEMMs reading one input, then an op that
combines them), lists :class:`Step` objects that say where each input comes from.
:func:`evaluate` walks either form for every consumer: the reference forward, metadata
inference, sharding propagation and the partition pass that builds graph nodes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from .base import BasicOp

__all__ = ["INPUT", "Step", "steps_of", "evaluate"]

#: In :attr:`Step.inputs`: the composite's main input.
INPUT = -1


@dataclasses.dataclass(frozen=True)
class Step:
    """One basic op of an expansion. ``inputs`` are its graph inputs, main first: :data:`INPUT`
    or the index of an earlier step. Extra inputs the op declares beyond these are taken from the
    composite's extra inputs, left to right."""

    op: BasicOp
    inputs: tuple[int, ...] = (INPUT,)
    #: What the step is called in graphs (``gate``, ``up``); default: the op's kind.
    name: str | None = None


def steps_of(expansion: Sequence[BasicOp | Step]) -> list[Step]:
    """Normalise an expansion: a bare op reads the previous step's output (the first one reads
    the composite's input)."""
    steps = []
    for index, item in enumerate(expansion):
        steps.append(item if isinstance(item, Step) else Step(item, (index - 1 if index else INPUT,)))
    for index, step in enumerate(steps):
        bad = [i for i in step.inputs if i != INPUT and not 0 <= i < index]
        if not step.inputs or bad:
            raise ValueError(f"expansion step {index} ({step.op.kind}): inputs {step.inputs} must be INPUT or "
                             f"earlier steps")
    return steps


def evaluate(expansion: Sequence[BasicOp | Step], x: Any, extras: Sequence[Any],
             apply: Callable[[Step, list, list], Any]) -> Any:
    """Run ``apply(step, inputs, taken_extras)`` for each step in order, with the values of its
    inputs; returns the last step's value. ``extras`` are the composite's extra inputs."""
    pending = list(extras)
    values: list[Any] = []
    for step in steps_of(expansion):
        args = [x if i == INPUT else values[i] for i in step.inputs]
        need = step.op.num_extra_inputs - (len(args) - 1)
        taken = [pending.pop(0) for _ in range(max(need, 0))]
        values.append(apply(step, args, taken))
    return values[-1]
