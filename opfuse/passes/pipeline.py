"""The pass pipeline, top to bottom. Each pass is ``fn(graph_module, ctx) -> None`` and edits the
graph in place; ``OPFUSE_DUMP`` writes the graph after each one."""

from __future__ import annotations

import dataclasses
from typing import Callable

from torch import fx

from .cleanup import cleanup
from .fusion import fuse
from .partition import partition
from .select import select_implementations
from .verify import verify

__all__ = ["Pass", "PIPELINE", "PassContext", "run_pipeline"]


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[fx.GraphModule, "PassContext"], None]


@dataclasses.dataclass
class PassContext:
    fusions: list = dataclasses.field(default_factory=list)
    #: A copy of the graph after partitioning, before fusion ("the unfused graph").
    unfused: fx.GraphModule | None = None


PIPELINE: tuple[Pass, ...] = (
    Pass("partition", partition),                      # expand composites, insert collectives
    Pass("fuse", fuse),                                # fusion rules by priority, to a fixed point
    Pass("cleanup", cleanup),                          # drop identities and dead values
    Pass("select_implementations", select_implementations),  # backend dispatch per fused op
    Pass("verify", verify),                            # lint and invariants
)


def run_pipeline(gm: fx.GraphModule, ctx: PassContext, after_pass: Callable[[str, fx.GraphModule], None]) -> None:
    after_pass("lowered", gm)
    for item in PIPELINE:
        item.run(gm, ctx)
        gm.recompile()
        after_pass(item.name, gm)
