"""``all_gather_linear_keep``: the all-gather of a sequence-parallel input fused with the GEMM that
reads it, returning the gathered input too, for graphs where something else reads it.

In a training graph traced by torch.compile the backward is already in the graph: the weight
gradients of the column-parallel GEMMs read the gathered activation (``dW = dY.T @ gathered``), and
q/k/v (gate/up) whose weights are stored apart read it as separate GEMMs. ``all_gather_linear``
cannot take such a gather (its value would have to exist twice); this op gathers once, overlaps
the gather with the largest GEMM reading it, and hands the gathered tensor to every other reader.

``AllGatherLinearKeep(weights, biases, group, split, batch)`` computes ``gathered =
all_gather_tokens(x)``, ``y = gathered @ [w_1; ...; w_k].T [+ b]`` and returns ``(y_1, ..., y_k,
gathered)`` (``y`` split back per weight) or ``(y, gathered)`` with ``split=False``. ``batch > 1``:
``x`` holds ``batch`` sequences' shards (sequence parallelism at batch > 1), so the gathered rows are
rank-major; ``y`` is returned batch-major (each sequence's tokens together, as the model's GEMM
computed them after putting the gathered value back in order), ``gathered`` rank-major as gathered. Forward only: it is used where fused
ops run without autograd (``PassContext.without_autograd``: torch.compile's aten graphs).

Custom op: ``opfuse::all_gather_linear_keep(x, weight, bias, group, impl) -> (y, gathered)``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from ...machinery.fused_op import FusedOp, define_fused_op
from ...machinery.implementation import CallSpec
from ...ops import group as groups
from ...ops.base import TensorMeta
from ...ops.packing import join_rows
from .implementations import TABLE as implementations

__all__ = ["AllGatherLinearKeep"]


def _forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], group: str, impl: str) -> tuple[Tensor, Tensor]:
    """Prototype: ``(y, gathered)``."""


def _fake(x, weight, bias, group, impl):
    world = groups.world_size(groups.from_name(group))
    gathered = x.new_empty((x.shape[0] * world,) + tuple(x.shape[1:]))
    return gathered.new_empty(tuple(gathered.shape[:-1]) + (weight.shape[0],)), gathered


AG_LINEAR_KEEP, _ = define_fused_op("all_gather_linear_keep", lookup=implementations.get, forward=_forward,
                                    fake=_fake)


class AllGatherLinearKeep(FusedOp):
    """All-gather + GEMM(s) that also returns the gathered input (see the module docstring)."""

    name = "all_gather_linear_keep"

    def __init__(self, weights: Sequence[nn.Parameter], biases: Sequence[nn.Parameter] | None = None, *,
                 group=None, split: bool = True, batch: int = 1):
        super().__init__()
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"AllGatherLinearKeep: batch={batch!r}; expected a positive int")
        if not weights:
            raise ValueError("AllGatherLinearKeep: needs at least one weight")
        if biases is not None and len(biases) != len(weights):
            raise ValueError(f"AllGatherLinearKeep: {len(weights)} weights but {len(biases)} biases")
        self.weights = nn.ParameterList(weights)
        self.biases = nn.ParameterList(biases) if biases is not None else None
        self.group, self.split, self.batch = group, bool(split), batch
        self.sizes = [w.shape[0] for w in weights]

    def extra_repr(self) -> str:
        text = f"in={self.weights[0].shape[1]}, outs={self.sizes}, all_gather={groups.group_name(self.group)}"
        if self.biases is not None:
            text += ", bias"
        if not self.split:
            text += ", packed"
        if self.batch > 1:
            text += f", batch-major y ({self.batch} sequences)"
        return text + (f", impl={self.impl}" if self.impl else "")

    def call_spec(self, metas: Sequence[TensorMeta]) -> CallSpec:
        first = self.weights[0]
        weight = TensorMeta((sum(self.sizes), first.shape[1]), first.dtype, first.device, False)
        bias = None
        if self.biases is not None:
            b = self.biases[0]
            bias = TensorMeta((sum(self.sizes),), b.dtype, b.device, False)
        return CallSpec(op=self.name, inputs={"x": metas[0], "weight": weight, "bias": bias},
                        attrs={"outputs": len(self.sizes)}, group_name=groups.group_name(self.group),
                        world_size=groups.world_size(self.group), requires_grad=False)

    def forward(self, x):
        if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in self.weights)):
            raise RuntimeError("all_gather_linear_keep has no backward: it serves graphs whose backward is already "
                               "traced (torch.compile); fuse with all_gather_linear under autograd")
        weight = join_rows(list(self.weights))
        bias = join_rows(list(self.biases)) if self.biases is not None else None
        y, gathered = AG_LINEAR_KEEP(x, weight, bias, groups.group_name(self.group), self._impl())
        if self.batch > 1:  # rows (rank, sequence, token) -> (sequence, rank, token): the sequences' order
            n = y.shape[-1]
            y = y.reshape(groups.world_size(self.group), self.batch, -1, n).transpose(0, 1).reshape(-1, n)
        outputs = tuple(y.split(self.sizes, dim=-1)) if self.split and len(self.sizes) > 1 else (y,)
        return (*outputs, gathered)
