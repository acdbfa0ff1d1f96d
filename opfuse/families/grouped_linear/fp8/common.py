"""What every ``grouped_linear_fp8`` implementation shares: the layer's sizes, its FP8 weight operand
(FSDP shards quantized locally and gathered as FP8), and the FSDP reduction of the gradients."""

from __future__ import annotations

import torch

from ....fp8 import grouped as fp8_grouped
from ....fp8.numerics import Quantized
from ....ops import group as groups
from ....ops.collectives import raw_all_gather, raw_reduce_scatter
from ....ops.grouped_fp8 import fp8_grouped_weight

__all__ = ["fsdp_group_of", "shape_of", "weight_operand", "weight_t_operand", "full_weight", "full_bias",
           "reduce_grads"]


def fsdp_group_of(name: str):
    return groups.from_name(name) if name else None


def shape_of(weight: torch.Tensor, fsdp_group: str, num_groups: int) -> tuple[int, int, int]:
    """``(G, N, K)`` of the full weight."""
    if not fsdp_group:
        return tuple(weight.shape)
    rows = weight.shape[0] * groups.world_size(fsdp_group_of(fsdp_group))
    return num_groups, rows // num_groups, weight.shape[1]


def weight_operand(weight: torch.Tensor, fsdp_group: str, num_groups: int, recipe) -> Quantized:
    """``data [G, N, K]``, ``scale_inv [G, N]`` (the reference quantizer and gather: torch ops, NCCL or
    gloo, a weight shard's FP8 bytes moved as ``uint8``)."""
    _, n, _ = shape_of(weight, fsdp_group, num_groups)
    return fp8_grouped_weight(weight, num_groups, n, recipe, fsdp_group_of(fsdp_group))


def full_weight(weight: torch.Tensor, fsdp_group: str, num_groups: int) -> torch.Tensor:
    """``[G, N, K]`` in the weight's dtype (all-gathered under FSDP)."""
    if not fsdp_group:
        return weight
    return raw_all_gather(weight, fsdp_group_of(fsdp_group)).view(shape_of(weight, fsdp_group, num_groups))


def weight_t_operand(weight: torch.Tensor, fsdp_group: str, num_groups: int, recipe) -> Quantized:
    """W.T for dgrad (:func:`opfuse.fp8.grouped.weight_t_operand`): from the FP8 operand (gathered in
    FP8) with one scale per expert, from the gathered high-precision weight with one per row."""
    if recipe.rowwise:
        return fp8_grouped.weight_t_operand(None, recipe, full_weight(weight, fsdp_group, num_groups))
    return fp8_grouped.weight_t_operand(weight_operand(weight, fsdp_group, num_groups, recipe), recipe)


def full_bias(bias: torch.Tensor | None, fsdp_group: str, num_groups: int) -> torch.Tensor | None:
    if bias is None or not fsdp_group:
        return bias
    return raw_all_gather(bias, fsdp_group_of(fsdp_group)).view(num_groups, -1)


def reduce_grads(dw: torch.Tensor, db: torch.Tensor, fsdp_group: str, need_dw: bool, need_db: bool, k: int):
    """Under FSDP, sum the full gradients over the group and keep this rank's rows."""
    if not fsdp_group:
        return dw, db
    pg = fsdp_group_of(fsdp_group)
    if need_dw:
        dw = raw_reduce_scatter(dw.reshape(-1, k), pg)
    if need_db:
        db = raw_reduce_scatter(db.reshape(-1), pg)
    return dw, db
