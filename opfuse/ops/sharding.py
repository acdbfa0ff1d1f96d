"""How a value is laid out over a process group, and the partition rules of a sharded GEMM.

Every graph value carries a :class:`Sharding`; each basic op says how it transforms one
(``BasicOp.propagate_sharding``), and composite ops expand into basic ops plus the collectives the
rules of :func:`plan_gemm` require. The partition pass calls them.

The rules for a sharded GEMM ``LHS [M, K] x RHS [K, N]`` (``RHS`` is the weight, stored
``[N, K]``; batch dims of the activation go with M and keep their partitioning):

1. RHS sharded on both K and N, or LHS sharded on both M and K: an error (1-D tensor
   parallelism shards one dim of each).
2. LHS sharded on M (sequence parallel), RHS sharded on N: all-gather LHS along M. The gather's
   backward reduce-scatters the GEMM's input gradient, a per-rank partial sum.
3. K of LHS follows K of RHS: RHS K-sharded and LHS replicated -> take this rank's slice of LHS's
   features (backward: all-gather the slices); LHS sharded on M -> one all-to-all to
   "every token, this rank's features" (backward: the inverse all-to-all); LHS K-sharded and
   RHS not -> an error.
4. RHS N-sharded and LHS replicated: the gradient of LHS is a partial sum -> ``GradAllReduce``.
5. K sharded: the output is a partial sum -> all-reduce it, or reduce-scatter it along M when
   the layer is sequence parallel (M and K sharded). A row-parallel bias follows the reduction.

Each collective here is paired with its exact conjugate in backward: a layer's input gradient has
the input's layout and is complete (summed over ranks) exactly where the input is replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .base import PartitionError

__all__ = ["Sharding", "REPLICATED", "PartitionError", "plan_gemm", "reject_partial"]


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Layout of an activation ``[tokens..., features]`` over ``group``.

    ``tokens``: dim 0 is split across ranks (sequence parallel); ``features``: the last dim is
    split (the output of a column-parallel GEMM); ``partial``: each rank holds a partial sum
    that still needs a reduction (the raw output of a row-parallel GEMM).
    """

    tokens: bool = False
    features: bool = False
    partial: bool = False
    group: Any = None

    @property
    def replicated(self) -> bool:
        return not (self.tokens or self.features or self.partial)

    def describe(self) -> str:
        if self.replicated:
            return "replicated"
        parts = [name for name in ("tokens", "features", "partial") if getattr(self, name)]
        return "+".join(f"{p}-sharded" if p != "partial" else "partial-sum" for p in parts)


REPLICATED = Sharding()


def reject_partial(op, x: Sharding, what: str = "input") -> None:
    """Raise :class:`PartitionError` when ``x`` is a partial sum (a row-parallel GEMM's output
    before its reduction): only linear ops of one operand may consume one."""
    if x.partial:
        raise PartitionError(
            f"{op.describe()}: its {what} is a partial sum (a row-parallel GEMM output before its reduction); put "
            f"the op after the AllReduce/ReduceScatter")


def plan_gemm(lhs: Sharding, rhs_k: bool, rhs_n: bool, sequence_parallel: bool, who: str = "GEMM"):
    """Apply the sharded-GEMM rules (module docstring). Returns ``(pre, reduce, out)``: collective
    kinds applied to LHS before the GEMM (``"all_gather"``, ``"split_features"``,
    ``"tokens_to_features"``, ``"grad_all_reduce"``), the reduction of the output (``None``, ``"all_reduce"``,
    ``"reduce_scatter"``), and the output sharding flags ``(tokens, features)``."""
    if rhs_k and rhs_n:
        raise PartitionError(
            f"{who}: the weight is sharded on both K (in_features) and N (out_features); 1-D tensor "
            f"parallelism shards one of them (parallel='row' for K, 'column' for N)"
        )
    if lhs.partial:
        raise PartitionError(f"{who}: its input is a partial sum; reduce it (AllReduce) before the GEMM")
    if lhs.tokens and lhs.features:
        raise PartitionError(
            f"{who}: its input is sharded on both tokens and features; 1-D tensor parallelism shards one of them")
    if lhs.features and not rhs_k:
        raise PartitionError(
            f"{who}: its input is sharded on features (K) but the weight is not sharded on K; "
            f"use parallel='row' for a layer that follows a column-parallel one"
        )
    pre = []
    tokens = lhs.tokens
    if rhs_n:
        # The gather's reduce-scatter backward sums the GEMM's partial input gradients; a
        # replicated input gets the same sum from GradAllReduce.
        pre.append("all_gather" if lhs.tokens else "grad_all_reduce")
        tokens = False
    elif rhs_k and lhs.tokens:
        # One all-to-all, not a gather then a slice: the gather's backward would sum complete
        # gradients over the ranks (world x too large).
        pre.append("tokens_to_features")
        tokens = False
    elif rhs_k and not lhs.features:
        pre.append("split_features")
    reduce = None
    if rhs_k:
        reduce = "reduce_scatter" if sequence_parallel else "all_reduce"
        tokens = sequence_parallel
    return pre, reduce, (tokens, rhs_n)
