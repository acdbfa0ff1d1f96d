"""Collective ops over a process group, with the tensor-parallel backward conventions.

Each forward/backward pair is the conjugate one (Megatron-LM's "f"/"g" regions):

====================  ===================================  ===================================
op                    forward                              backward
====================  ===================================  ===================================
``AllReduce``         sum over ranks                       identity
``GradAllReduce``     identity                             sum over ranks
``AllGather``         concatenate ranks along dim 0        reduce-scatter along dim 0
``ReduceScatter``     reduce-scatter along dim 0           all-gather along dim 0
``SplitFeatures``     this rank's slice of features        all-gather along the last dim
``TokensToFeatures``  all-to-all: tokens -> features       all-to-all: features -> tokens
====================  ===================================  ===================================

The gradient of a replicated value is complete on every rank, except where a column-parallel
GEMM consumes it (its input gradient is a per-rank partial sum): ``GradAllReduce`` marks that
spot, and ``AllGather``'s reduce-scatter backward assumes it (a sequence-parallel gather feeds
the column GEMM). A partial sum's gradient is the complete gradient of the sum.

The functions (:func:`all_reduce`, ...) are the reference implementations that fused ops and the
backend fall back on.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..fp8.tensor import Float8Activation
from . import group as groups
from .base import BasicOp, OpInputError, PartitionError, TensorMeta
from .sharding import REPLICATED, Sharding

__all__ = [
    "AllReduce",
    "GradAllReduce",
    "AllGather",
    "ReduceScatter",
    "SplitFeatures",
    "TokensToFeatures",
    "all_reduce",
    "grad_all_reduce",
    "all_gather",
    "reduce_scatter",
    "split_features",
    "tokens_to_features",
    "raw_all_reduce",
    "raw_all_gather",
    "raw_reduce_scatter",
    "all_gather_fp8",
    "start_all_gather",
    "start_reduce_scatter",
]


# Raw (non-differentiable) collectives --------------------------------------------------------

# torch >= 2.13 renamed the tensor collectives (the old names warn); 2.11/2.12 only have the old ones.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def raw_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=groups.resolve(group))
    return out


def raw_all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0."""
    pg = groups.resolve(group)
    world = dist.get_world_size(pg)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * world,) + tuple(x.shape[1:]))
    _all_gather_tensor(out, x, group=pg)
    return out


def start_all_gather(x: torch.Tensor, group):
    """Begin concatenating every rank's ``x`` along dim 0: ``(out, work)``; ``out`` is ready after
    ``work.wait()`` (the caller's stream then waits for the collective, the host does not)."""
    pg = groups.resolve(group)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * dist.get_world_size(pg),) + tuple(x.shape[1:]))
    return out, _all_gather_tensor(out, x, group=pg, async_op=True)


def start_reduce_scatter(x: torch.Tensor, group):
    """Begin summing ``x`` over ranks and keeping this rank's block of dim 0: ``(out, work)``."""
    pg = groups.resolve(group)
    world = dist.get_world_size(pg)
    if x.shape[0] % world:
        raise OpInputError(f"ReduceScatter: dim 0 has size {x.shape[0]}, which is not divisible by the world size "
                           f"{world}")
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:]))
    return out, _reduce_scatter_tensor(out, x, group=pg, async_op=True)


def all_gather_fp8(x: Float8Activation, group) -> Float8Activation:
    """Every rank's FP8 activation concatenated along dim 0: the FP8 bytes and the scales move,
    not the values. One scale per tensor becomes one per row (each rank's scale on its rows):
    the exact value whether or not the ranks' scales agree."""
    pg = groups.resolve(group)
    data = raw_all_gather(x._data.view(torch.uint8), pg).view(x._data.dtype)
    rows = x._data.reshape(-1, x._data.shape[-1]).shape[0] if x._data.dim() else 1
    scale = x._scale_inv if x.rowwise else x._scale_inv.expand(rows, 1)
    return Float8Activation(data, raw_all_gather(scale, pg), x.dtype)


def raw_reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ranks, then keep this rank's block of dim 0."""
    pg = groups.resolve(group)
    world = dist.get_world_size(pg)
    if x.shape[0] % world:
        raise OpInputError(
            f"ReduceScatter: dim 0 has size {x.shape[0]}, which is not divisible by the world "
            f"size {world}"
        )
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:]))
    _reduce_scatter_tensor(out, x, group=pg)
    return out


def _raw_tokens_to_features(x: torch.Tensor, group) -> torch.Tensor:
    """``[T/w, ..., K]`` (this rank's tokens) -> ``[T, ..., K/w]`` (every token, this rank's
    features), with one all-to-all."""
    pg = groups.resolve(group)
    world = dist.get_world_size(pg)
    lead, width = x.shape[0], x.shape[-1] // world
    middle = math.prod(x.shape[1:-1])  # not -1: a reshape cannot infer it when there are no tokens
    # Chunk j (sent to rank j) holds this rank's tokens, features of slice j.
    parts = x.reshape(lead, middle, world, width).permute(2, 0, 1, 3).contiguous()
    out = torch.empty_like(parts)
    dist.all_to_all_single(out, parts, group=pg)
    return out.reshape((world * lead,) + tuple(x.shape[1:-1]) + (width,))


def _raw_features_to_tokens(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`_raw_tokens_to_features`: ``[T, ..., K/w]`` -> ``[T/w, ..., K]``."""
    pg = groups.resolve(group)
    world = dist.get_world_size(pg)
    lead, width = y.shape[0] // world, y.shape[-1]
    # Chunk j (sent to rank j) holds rank j's tokens of this rank's feature slice.
    parts = y.reshape(world, lead, math.prod(y.shape[1:-1]), width).contiguous()
    out = torch.empty_like(parts)
    dist.all_to_all_single(out, parts, group=pg)
    return out.permute(1, 2, 0, 3).reshape((lead,) + tuple(y.shape[1:-1]) + (world * width,))


def _raw_all_gather_features(x: torch.Tensor, group) -> torch.Tensor:
    pg = groups.resolve(group)
    world = dist.get_world_size(pg)
    parts = [torch.empty_like(x.contiguous()) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=pg)
    return torch.cat(parts, dim=-1)


# Differentiable collectives ---------------------------------------------------------------


class _AllReduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return raw_all_reduce(x, group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _GradAllReduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return raw_all_reduce(dy, ctx.group), None


def _gather_tokens(x, group):
    """Every rank's ``x`` along dim 0; an FP8 activation is gathered as FP8 (payload and scales)."""
    if isinstance(x, Float8Activation):
        return all_gather_fp8(x, group)
    return raw_all_gather(x, group)


def _local_features(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous slice of the last dim."""
    world, rank = groups.world_size(group), groups.rank(group)
    width = x.shape[-1] // world
    return x[..., rank * width:(rank + 1) * width].contiguous()


def _conjugates(name: str, forward, backward) -> type:
    """An ``autograd.Function`` running ``forward(x, group)``, whose gradient is
    ``backward(dy, group)`` (the conjugate collective)."""

    class Conjugates(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, dy):
            return backward(dy, ctx.group), None

    Conjugates.__name__ = Conjugates.__qualname__ = f"_{name}Fn"
    return Conjugates


_AllGatherFn = _conjugates("AllGather", _gather_tokens, raw_reduce_scatter)
_ReduceScatterFn = _conjugates("ReduceScatter", raw_reduce_scatter, raw_all_gather)
_SplitFeaturesFn = _conjugates("SplitFeatures", _local_features, _raw_all_gather_features)
_TokensToFeaturesFn = _conjugates("TokensToFeatures", _raw_tokens_to_features, _raw_features_to_tokens)


def all_reduce(x, group=None):
    """Sum ``x`` over the ranks of ``group``; the gradient passes through unchanged."""
    return _AllReduceFn.apply(x, group)


def grad_all_reduce(x, group=None):
    """Identity; the gradient is summed over the ranks of ``group``."""
    return _GradAllReduceFn.apply(x, group)


def all_gather(x, group=None):
    """Concatenate ``x`` of every rank along dim 0; the gradient is reduce-scattered."""
    return _AllGatherFn.apply(x, group)


def reduce_scatter(x, group=None):
    """Sum over ranks and keep this rank's block of dim 0; the gradient is all-gathered."""
    return _ReduceScatterFn.apply(x, group)


def split_features(x, group=None):
    """This rank's contiguous slice of the last dim; the gradient is all-gathered."""
    return _SplitFeaturesFn.apply(x, group)


def tokens_to_features(x, group=None):
    """Token-sharded ``x`` -> every token, this rank's slice of features (an all-to-all); the
    gradient goes back with the inverse all-to-all."""
    return _TokensToFeaturesFn.apply(x, group)


# Ops ------------------------------------------------------------------------------------


class _CollectiveOp(BasicOp):
    is_collective = True

    def __init__(self, group=None):
        super().__init__()
        self.group = groups.check(group, type(self).__name__)

    def process_groups(self) -> list:
        return [self.group]

    @property
    def world_size(self) -> int:
        return groups.world_size(self.group)

    def extra_repr(self) -> str:
        if self.group is None:
            return "group=default"
        try:
            return f"group={self.group.group_name}"
        except Exception:  # pragma: no cover - exotic group objects
            return "group=?"

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        if len(x.shape) < 1:
            raise OpInputError(f"{self.describe()}: input must have at least 1 dim")
        return x

    def _require_token_dim(self, x: TensorMeta) -> None:
        # Dim 0 of a 1-D value is its features: gathering or scattering it would split features.
        if len(x.shape) < 2:
            raise OpInputError(f"{self.describe()}: input has shape {list(x.shape)}; a token-sharded (sequence-"
                               f"parallel) value needs a token dim before its features: [tokens, ..., features]")


class AllReduce(_CollectiveOp):
    """Sum over the ranks of ``group`` (e.g. after a row-parallel GEMM). Backward: identity."""

    def forward(self, x):
        return all_reduce(x, self.group)

    def propagate_sharding(self, x: Sharding, *extra) -> Sharding:
        """A partial sum becomes whole; the token layout stays."""
        return Sharding(tokens=True, group=x.group) if x.tokens else REPLICATED


class GradAllReduce(_CollectiveOp):
    """Identity forward; sums the gradient over ``group`` in backward.

    It marks where a replicated activation enters a column-parallel GEMM: each rank's
    ``dx`` is a partial sum there.
    """

    keeps_quantized = True

    def forward(self, x):
        return grad_all_reduce(x, self.group)

    def propagate_sharding(self, x: Sharding, *extra) -> Sharding:
        """Identity forward: the layout is unchanged."""
        return x


class AllGather(_CollectiveOp):
    """Concatenate every rank's tokens along dim 0. Backward: reduce-scatter.

    An FP8 activation is gathered as FP8 bytes plus its scales (:func:`all_gather_fp8`)."""

    keeps_quantized = True

    def forward(self, x):
        return all_gather(x, self.group)

    def natural_input_sharding(self, x: TensorMeta) -> Sharding:
        return Sharding(tokens=True, group=self.group)

    def propagate_sharding(self, x: Sharding, *extra) -> Sharding:
        """Tokens become whole; a feature sharding stays."""
        if x.partial:
            raise PartitionError(f"{self.describe()}: its input is a partial sum; reduce-scatter it instead of "
                                 f"gathering it")
        return Sharding(features=x.features, group=x.group) if x.features else REPLICATED

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        super().infer_meta(x)
        self._require_token_dim(x)
        quantized = x.quantized
        if quantized is not None and self.world_size > 1:
            quantized = quantized.split("/")[0] + "/row"  # each rank's scale on its own rows
        return x.with_(shape=(x.shape[0] * self.world_size,) + x.shape[1:], quantized=quantized)


class ReduceScatter(_CollectiveOp):
    """Sum over ranks and keep this rank's block of dim 0 (tokens). Backward: all-gather."""

    def forward(self, x):
        return reduce_scatter(x, self.group)

    def propagate_sharding(self, x: Sharding, *extra) -> Sharding:
        """Sums over ranks and splits the tokens."""
        return Sharding(tokens=True, group=self.group)

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        super().infer_meta(x)
        self._require_token_dim(x)
        world = self.world_size
        if x.shape[0] % world:
            raise OpInputError(
                f"{self.describe()}: dim 0 of input {list(x.shape)} is {x.shape[0]}, not divisible "
                f"by the world size {world}"
            )
        return x.with_(shape=(x.shape[0] // world,) + x.shape[1:])


class SplitFeatures(_CollectiveOp):
    """Keep this rank's slice of the last dim (a replicated input entering a row-parallel GEMM).
    Backward: all-gather along the last dim."""

    def forward(self, x):
        return split_features(x, self.group)

    def propagate_sharding(self, x: Sharding, *extra) -> Sharding:
        """Keeps this rank's slice of the features."""
        return Sharding(tokens=x.tokens, features=True, group=self.group)

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        super().infer_meta(x)
        world = self.world_size
        if x.features % world:
            raise OpInputError(
                f"{self.describe()}: {x.features} features are not divisible by the world size {world}"
            )
        return x.with_(shape=x.shape[:-1] + (x.features // world,))


class TokensToFeatures(_CollectiveOp):
    """Re-shard a token-sharded value on features: every token, this rank's slice of features
    (one all-to-all). What a row-parallel GEMM needs from a sequence-parallel activation.
    Backward: the inverse all-to-all."""

    def forward(self, x):
        return tokens_to_features(x, self.group)

    def natural_input_sharding(self, x: TensorMeta) -> Sharding:
        return Sharding(tokens=True, group=self.group)

    def propagate_sharding(self, x: Sharding, *extra) -> Sharding:
        """Tokens become whole, features sharded."""
        if x.partial or x.features:
            raise PartitionError(f"{self.describe()}: expects a token-sharded value, got {x.describe()}")
        return Sharding(features=True, group=self.group)

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        super().infer_meta(x)
        self._require_token_dim(x)
        world = self.world_size
        if x.features % world:
            raise OpInputError(
                f"{self.describe()}: {x.features} features are not divisible by the world size {world}")
        return x.with_(shape=(x.shape[0] * world,) + x.shape[1:-1] + (x.features // world,))
