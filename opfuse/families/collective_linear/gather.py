"""``all_gather_tokens``: a token all-gather on its own, pushed over peer memory by the copy engines.

In a training graph traced by torch.compile, the backward's all-gather of a sequence-parallel
output's gradient has no recognised GEMM next to it (the backward's GEMMs are aten ``mm`` /
``_scaled_mm``, and in FP8 the gathered gradient is quantized first), so no collective + GEMM
fusion takes it and it would stay NCCL's. NCCL's kernel needs SMs: inside a CUDA graph it waits
for the persistent weight-gradient GEMM scheduled beside it, and leaving it SMs slows both
(docs/PERF_NOTES.md, "Results, session 21"). The copy engines need none: this op runs the
gather-only plan of the overlap pipelines (each rank pushes its rows into every peer's gathered
region and copies them into its own), then copies the gathered region out, since peers write it
again at this rank's next overlap call.

``AllGatherTokens(group)`` computes what ``all_gather_into_tensor`` + ``wait_tensor`` do: every
rank's ``x`` concatenated along dim 0, rank-major. Forward only: it serves graphs whose backward is
already traced (``PassContext.without_autograd``).

Custom op: ``opfuse::all_gather_tokens(x, group, impl) -> gathered``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ...machinery.fused_op import FusedOp, define_fused_op
from ...machinery.implementation import CallSpec
from ...ops import group as groups
from ...ops.base import TensorMeta
from .implementations import TABLE as implementations

__all__ = ["AllGatherTokens"]


def _forward(x: Tensor, group: str, impl: str) -> Tensor:
    """Prototype: every rank's ``x`` along dim 0."""


def _fake(x, group, impl):
    world = groups.world_size(groups.from_name(group))
    return x.new_empty((x.shape[0] * world,) + tuple(x.shape[1:]))


ALL_GATHER_TOKENS, _ = define_fused_op("all_gather_tokens", lookup=implementations.get, forward=_forward,
                                       fake=_fake)


class AllGatherTokens(FusedOp):
    """Every rank's tokens concatenated along dim 0 (see the module docstring)."""

    name = "all_gather_tokens"
    # The reference is torch.distributed's all-gather in line, where the graph had NCCL's
    # asynchronous one: a graph Inductor compiles keeps its own collective instead, on any device.
    reference_is_unfused = True
    reference_is_slower = True

    def __init__(self, *, group=None):
        super().__init__()
        self.group = group

    def extra_repr(self) -> str:
        return f"all_gather={groups.group_name(self.group)}" + (f", impl={self.impl}" if self.impl else "")

    def call_spec(self, metas: Sequence[TensorMeta]) -> CallSpec:
        return CallSpec(op=self.name, inputs={"x": metas[0]}, attrs={}, group_name=groups.group_name(self.group),
                        world_size=groups.world_size(self.group), requires_grad=False)

    def forward(self, x):
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("all_gather_tokens has no backward: it serves graphs whose backward is already traced "
                               "(torch.compile); use opfuse.ops.AllGather under autograd")
        return ALL_GATHER_TOKENS(x, groups.group_name(self.group), self._impl())
