"""Grouped GEMMs for mixture-of-experts: :class:`GroupedLinear` (the user-facing layer, with
expert-parallel and FSDP weight sharding) and :class:`BasicGroupedLinear` (the local grouped GEMM
the partition pass expands it into).

The math, for ``x [T, K]`` whose rows are sorted by group and ``group_sizes [G]`` (on x's device)::

    rows of group g:  [s_g, e_g)  with  e_g = min(sizes[0] + ... + sizes[g], T),  s_g = e_{g-1}
    y[s_g:e_g] = x[s_g:e_g] @ weight[g].T (+ bias[g])
    y[e_{G-1}:T] = 0          # rows past sum(group_sizes): a static-shape buffer's unused tail

Letting ``sum(group_sizes) <= T`` matters for CUDA graphs: the token buffer keeps one (maximum)
shape while the routing changes from step to step on the device. The unused tail is defined (zero
output, zero input gradient, no contribution to weight gradients) rather than left uninitialised,
so a caller that reads it gets zeros, not stale memory.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import config, parse_force_impl
from ..fp8.recipe import Recipe
from . import collectives as coll
from . import group as groups
from .base import BasicOp, ImplementationError, OpInputError, PartitionError, TensorMeta, dtype_name
from .grouped_fp8 import Fp8GroupedFn, fp8_grouped_weight
from .sharding import REPLICATED, Sharding, reject_partial

__all__ = ["GroupedLinear", "BasicGroupedLinear", "grouped_linear_reference", "check_group_sizes_meta",
           "fp8_grouped_weight"]

_PARALLEL_MODES = (None, "expert", "fsdp", "expert+fsdp")
#: The fused op a compiled block runs for this layer (its key in ``OPFUSE_FORCE_IMPL``).
_FUSED_OP = "grouped_linear"
_SIZE_DTYPES = (torch.int32, torch.int64)


def grouped_linear_reference(x: torch.Tensor, group_sizes: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable pure-torch grouped linear (reads ``group_sizes`` on the host: syncs).

    ``x [T, K]``, ``group_sizes [G]``, ``weight [G, N, K]``, ``bias [G, N]`` or ``None``;
    returns ``y [T, N]`` with the tail past ``sum(group_sizes)`` zero. Raises ``ValueError`` for
    negative sizes or ``sum(group_sizes) > T`` (the GPU kernels cannot check without a sync and
    clamp instead; see the module docstring).
    """
    counts = [int(c) for c in group_sizes.tolist()]
    tokens = x.shape[0]
    if any(c < 0 for c in counts) or sum(counts) > tokens:
        raise ValueError(
            f"grouped_linear: group_sizes {counts} must be non-negative and sum to at most the "
            f"{tokens} rows of x")
    pieces, start = [], 0
    for g, count in enumerate(counts):
        if count:
            pieces.append(F.linear(x[start:start + count], weight[g], None if bias is None else bias[g]))
        start += count
    if start < tokens:
        pieces.append(x.new_zeros(tokens - start, weight.shape[1]))
    if not pieces:
        return x.new_zeros(0, weight.shape[1])
    y = torch.cat(pieces)
    if not any(counts):
        # No group has tokens: keep the inputs in the autograd graph anyway (zero gradients), as
        # the fused implementations do, so optimizers and FSDP see a gradient on every rank.
        # An empty slice's sum is an exact 0 whatever the values (no 0 * inf).
        for t in (x, weight, bias):
            if t is not None and t.requires_grad:
                y = y + t.reshape(-1)[:0].sum()
    return y


def check_group_sizes_meta(op: BasicOp, x: TensorMeta, sizes: TensorMeta, num_groups: int) -> None:
    """Raise :class:`OpInputError` unless ``sizes`` is a 1-D int32/int64 tensor of ``num_groups``
    entries on x's device."""
    if sizes.dtype not in _SIZE_DTYPES:
        raise OpInputError(
            f"{op.describe()}: group_sizes has dtype {dtype_name(sizes.dtype)}, expected int32 or int64")
    if len(sizes.shape) != 1 or sizes.shape[0] != num_groups:
        raise OpInputError(
            f"{op.describe()}: group_sizes has shape {list(sizes.shape)}, expected [{num_groups}] "
            f"(one count per local group)")
    if torch.device(sizes.device) != torch.device(x.device):
        raise OpInputError(
            f"{op.describe()}: group_sizes is on {sizes.device} but x is on {x.device}; keep the "
            f"counts on the device (reading them back to the host would stall the stream)")


def _infer_meta(op: BasicOp, x: TensorMeta, extra, num_groups: int, out_features: int) -> TensorMeta:
    """Checks shared by :class:`GroupedLinear` and :class:`BasicGroupedLinear`; the output meta."""
    if len(extra) != 1:
        raise OpInputError(f"{op.describe()}: expected one extra input (group_sizes), got {len(extra)}")
    if len(x.shape) != 2:
        raise OpInputError(
            f"{op.describe()}: x has shape {list(x.shape)}, expected 2 dims [tokens, {op.in_features}] "
            f"(tokens sorted by group)")
    op._require_float(x, "x")
    op._require_features(x, op.in_features, "x")
    check_group_sizes_meta(op, x, extra[0], num_groups)
    params = [op.weight, op.bias]
    op._require_param_match(x, params, "x")
    grad = x.requires_grad or any(p is not None and p.requires_grad for p in params)
    return x.with_(shape=(x.shape[0], out_features), requires_grad=grad)


class BasicGroupedLinear(BasicOp):
    """The local grouped GEMM ``y[rows of g] = x[rows of g] @ weight[g].T (+ bias[g])``.

    It holds the parameters of a :class:`GroupedLinear` (shared, not copied). With
    ``fsdp_group`` set, ``weight``/``bias`` are this rank's shards (contiguous rows of the
    ``[G * N, K]`` / ``[G * N]`` views) and are all-gathered before use; their gradients are
    reduce-scattered (summed over the FSDP group).

    Parameters
    ----------
    num_groups, in_features, out_features:
        Local sizes: the GEMM runs ``num_groups`` experts of ``[out_features, in_features]``.
    weight, bias:
        The parameters (see above for their shapes under FSDP).
    fsdp_group:
        The process group the parameters are sharded over, or ``None``.
    recipe:
        An :mod:`opfuse.fp8` recipe: the GEMM and its data gradient run on FP8 operands (x
        quantized here; FSDP weights gathered as FP8); the weight gradient too with
        ``recipe.fp8_wgrad`` (one scale per expert and feature), else in float32 accumulation of
        the parameter-dtype operands. Set by the FP8 pass under :func:`opfuse.fp8.autocast`.
    """

    num_extra_inputs = 1

    def __init__(self, num_groups: int, in_features: int, out_features: int, *, weight: nn.Parameter,
                 bias: nn.Parameter | None = None, fsdp_group=None, fsdp: bool = False,
                 recipe: Recipe | None = None):
        super().__init__()
        self.recipe = recipe
        self.num_groups = int(num_groups)
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.fsdp = bool(fsdp or fsdp_group is not None)
        self.fsdp_group = fsdp_group
        world = groups.world_size(fsdp_group) if self.fsdp else 1
        rows = self.num_groups * self.out_features
        want_w = (rows // world, in_features) if self.fsdp else (num_groups, out_features, in_features)
        want_b = (rows // world,) if self.fsdp else (num_groups, out_features)
        if tuple(weight.shape) != want_w:
            raise OpInputError(f"BasicGroupedLinear: weight has shape {list(weight.shape)}, expected {list(want_w)}")
        if bias is not None and tuple(bias.shape) != want_b:
            raise OpInputError(f"BasicGroupedLinear: bias has shape {list(bias.shape)}, expected {list(want_b)}")
        self.weight = weight
        self.bias = bias

    def extra_repr(self) -> str:
        text = (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")
        text += ", fsdp" if self.fsdp else ""
        return text + (f", fp8={self.recipe.describe()}" if self.recipe is not None else "")

    def with_recipe(self, recipe: Recipe | None) -> "BasicGroupedLinear":
        """The same grouped GEMM (sharing the parameters) with FP8 ``recipe``."""
        return BasicGroupedLinear(self.num_groups, self.in_features, self.out_features, weight=self.weight,
                                  bias=self.bias, fsdp_group=self.fsdp_group, fsdp=self.fsdp, recipe=recipe)

    def full_weight_value(self, weight: torch.Tensor) -> torch.Tensor:
        """``[G, N, K]`` weight from this rank's ``weight`` (gathered under FSDP; not differentiable)."""
        if not self.fsdp:
            return weight
        return coll.raw_all_gather(weight, self.fsdp_group).view(self.num_groups, self.out_features, self.in_features)

    def full_bias_value(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``[G, N]`` bias from this rank's ``bias`` (gathered under FSDP; not differentiable)."""
        if bias is None or not self.fsdp:
            return bias
        return coll.raw_all_gather(bias, self.fsdp_group).view(self.num_groups, self.out_features)

    def full_weight(self) -> torch.Tensor:
        """``[G, N, K]``: the parameter, or its all-gather under FSDP (differentiable)."""
        if not self.fsdp:
            return self.weight
        full = coll.all_gather(self.weight, self.fsdp_group)
        return full.view(self.num_groups, self.out_features, self.in_features)

    def full_bias(self) -> torch.Tensor | None:
        if self.bias is None or not self.fsdp:
            return self.bias
        return coll.all_gather(self.bias, self.fsdp_group).view(self.num_groups, self.out_features)

    def forward(self, x, group_sizes):
        if self.recipe is not None:
            return Fp8GroupedFn.apply(x, group_sizes, self.weight, self.bias, self)
        return grouped_linear_reference(x, group_sizes, self.full_weight(), self.full_bias())

    def propagate_sharding(self, x: Sharding, *extra) -> Sharding:
        """Rows are independent: any token layout; every input feature, reduced."""
        if x.features:
            raise PartitionError(f"{self.describe()}: its input is sharded on features; a grouped GEMM needs all "
                                 f"{self.in_features} input features per token")
        reject_partial(self, x)
        return x

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        return _infer_meta(self, x, extra, self.num_groups, self.out_features)


class GroupedLinear(BasicOp):
    """Mixture-of-experts grouped linear layer: ``num_groups`` experts, each ``y = x @ W_g.T + b_g``
    over its own contiguous rows of ``x``.

    Called as ``y = layer(x, group_sizes)`` or inside ``ops.Sequential(...)(x, group_sizes)``:
    ``x [T, in_features]`` holds the tokens sorted by group, ``group_sizes`` (int32 or int64, on
    x's device, one entry per *local* group) how many rows each group owns. Rows past
    ``sum(group_sizes)`` produce zeros (a fixed-size buffer for CUDA graphs). The GPU
    implementations never read ``group_sizes`` on the host: no stream stall, CUDA-graph capturable.

    Design: a composite op. The partition pass calls :meth:`expand`, which checks the input's
    layout and returns one :class:`BasicGroupedLinear` that owns the (sharded) parameters; the
    FSDP all-gather and reduce-scatter of the *parameters* happen inside that op (and inside the
    fused ``grouped_linear`` custom op), because parameters are not graph values the pass could
    route collectives through. Token exchange (the expert-parallel all-to-all) stays outside:
    the layer sees the tokens its rank's experts own.

    Parameters
    ----------
    num_groups, in_features, out_features:
        Global sizes: ``num_groups`` experts of ``[out_features, in_features]``.
    bias:
        A bias per expert (``[num_groups, out_features]`` unsharded).
    parallel:
        ``None``; ``"expert"`` (experts split evenly over ``group``: rank r holds experts
        ``[r * G / world, (r + 1) * G / world)``, ``weight [G / world, N, K]``, and receives only
        their tokens); ``"fsdp"`` (every rank runs all experts; the weight is sharded over
        ``group`` as contiguous rows of its ``[G * N, K]`` view, ``weight [G * N / world, K]``,
        gathered before use, gradients reduce-scattered); ``"expert+fsdp"`` (experts over
        ``group``, each rank's experts sharded over ``fsdp_group``).
    group:
        The expert-parallel group (``"expert"``, ``"expert+fsdp"``) or the FSDP group
        (``"fsdp"``); ``None`` means the default group.
    fsdp_group:
        The FSDP group of ``"expert+fsdp"`` (must differ from ``group``).

    Examples
    --------
    >>> experts = ops.GroupedLinear(32, 7168, 2048, device="cuda", dtype=torch.bfloat16)
    >>> y = ops.Sequential(experts)(x_sorted, tokens_per_expert)          # doctest: +SKIP
    >>> ep = ops.GroupedLinear(32, 7168, 2048, parallel="expert", group=ep_group)  # doctest: +SKIP
    >>> ep.load_unsharded(full_weight)                                    # doctest: +SKIP
    """

    is_composite = True
    num_extra_inputs = 1

    def __init__(self, num_groups: int, in_features: int, out_features: int, bias: bool = False,
                 parallel=None, group=None, fsdp_group=None, device=None, dtype=None):
        super().__init__()
        for name, value in (("num_groups", num_groups), ("in_features", in_features),
                            ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GroupedLinear: {name}={value!r}; expected a positive int")
        if not isinstance(bias, bool):
            raise TypeError(f"GroupedLinear: bias={bias!r}; expected True or False")
        if parallel not in _PARALLEL_MODES:
            raise ValueError(
                f"GroupedLinear: parallel={parallel!r}; accepted: None, 'expert', 'fsdp', 'expert+fsdp'")
        if fsdp_group is not None and parallel != "expert+fsdp":
            raise ValueError(
                f"GroupedLinear(parallel={parallel!r}): fsdp_group= is only used with "
                f"parallel='expert+fsdp' (for parallel='fsdp' pass the FSDP group as group=)")
        groups.check(group, "GroupedLinear")
        groups.check(fsdp_group, "GroupedLinear")
        self.num_groups = num_groups
        self.in_features = in_features
        self.out_features = out_features
        self.parallel = parallel
        self.expert_group = group if parallel in ("expert", "expert+fsdp") else None
        self.fsdp_group = {"fsdp": group, "expert+fsdp": fsdp_group}.get(parallel)
        self.expert_world, self.expert_rank = 1, 0
        if parallel in ("expert", "expert+fsdp"):
            self.expert_world, self.expert_rank = groups.world_size(group), groups.rank(group)
        self.fsdp_world, self.fsdp_rank = 1, 0
        if parallel in ("fsdp", "expert+fsdp"):
            if parallel == "expert+fsdp":
                if fsdp_group is None:
                    raise ValueError("GroupedLinear(parallel='expert+fsdp'): pass fsdp_group= (the FSDP "
                                     "process group, different from the expert-parallel group=)")
                if groups.same_group(group, fsdp_group):
                    raise ValueError(
                        f"GroupedLinear(parallel='expert+fsdp'): the expert-parallel group and the FSDP "
                        f"group are the same group ({groups.group_name(group)!r}); experts and their "
                        f"weight shards need two different groups (e.g. EP within a node, FSDP across)")
            self.fsdp_world, self.fsdp_rank = groups.world_size(self.fsdp_group), groups.rank(self.fsdp_group)
        if num_groups % self.expert_world:
            raise ValueError(
                f"GroupedLinear(parallel={parallel!r}): num_groups={num_groups} is not divisible by the "
                f"expert-parallel world size {self.expert_world}")
        self.local_num_groups = num_groups // self.expert_world
        rows = self.local_num_groups * out_features
        if rows % self.fsdp_world:
            raise ValueError(
                f"GroupedLinear(parallel={parallel!r}): the {rows} weight rows (local num_groups "
                f"{self.local_num_groups} x out_features {out_features}) are not divisible by the FSDP "
                f"world size {self.fsdp_world}")
        shape = (rows // self.fsdp_world, in_features) if self.fsdp else (self.local_num_groups, out_features,
                                                                          in_features)
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        bound = 1.0 / math.sqrt(in_features)  # nn.Linear's default range, from the real fan-in
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
        if bias:
            bshape = (rows // self.fsdp_world,) if self.fsdp else (self.local_num_groups, out_features)
            self.bias = nn.Parameter(torch.zeros(bshape, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self._basic: BasicGroupedLinear | None = None

    @property
    def fsdp(self) -> bool:
        return self.parallel in ("fsdp", "expert+fsdp")

    def process_groups(self) -> list:
        used = []
        if self.parallel in ("expert", "expert+fsdp"):
            used.append(self.expert_group)
        if self.fsdp:
            used.append(self.fsdp_group)
        return used

    @property
    def first_group(self) -> int:
        """Global index of this rank's first expert."""
        return self.expert_rank * self.local_num_groups

    def extra_repr(self) -> str:
        text = (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")
        if self.parallel:
            text += f", parallel={self.parallel!r}"
            if self.expert_world > 1 or self.parallel.startswith("expert"):
                text += f", experts={self.local_num_groups}/rank"
            if self.fsdp:
                text += f", fsdp_world={self.fsdp_world}"
        return text

    def load_unsharded(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's part of the full ``weight [num_groups, out, in]`` (and ``bias [num_groups, out]``)."""
        want = (self.num_groups, self.out_features, self.in_features)
        if tuple(weight.shape) != want:
            raise ValueError(f"GroupedLinear.load_unsharded: weight has shape {list(weight.shape)}, "
                             f"expected {list(want)}")
        if bias is not None and self.bias is None:
            raise ValueError("GroupedLinear.load_unsharded: got a bias but the layer has bias=False")
        if bias is not None and tuple(bias.shape) != want[:2]:
            raise ValueError(f"GroupedLinear.load_unsharded: bias has shape {list(bias.shape)}, "
                             f"expected {list(want[:2])}")
        experts = slice(self.first_group, self.first_group + self.local_num_groups)
        with torch.no_grad():
            local_w = weight[experts]
            local_b = None if bias is None else bias[experts]
            if self.fsdp:
                rows = self.weight.shape[0]
                part = slice(self.fsdp_rank * rows, (self.fsdp_rank + 1) * rows)
                local_w = local_w.reshape(-1, self.in_features)[part]
                local_b = None if local_b is None else local_b.reshape(-1)[part]
            self.weight.copy_(local_w)
            if local_b is not None:
                self.bias.copy_(local_b)

    # Partition -------------------------------------------------------------------------------

    def basic_op(self) -> BasicGroupedLinear:
        """The local grouped GEMM over this layer's parameters (built once, shared)."""
        basic = self._basic
        if basic is None or basic.weight is not self.weight or basic.bias is not self.bias:
            # Bypass nn.Module registration: the basic op shares our parameters, it is not a child.
            object.__setattr__(self, "_basic", BasicGroupedLinear(
                self.local_num_groups, self.in_features, self.out_features, weight=self.weight,
                bias=self.bias, fsdp_group=self.fsdp_group, fsdp=self.fsdp))
        return self._basic

    def expand(self, sharding: Sharding) -> tuple[list[BasicOp], Sharding]:
        """The basic ops for an input laid out as ``sharding``, and the output's layout.

        Tokens may be replicated or split over any group (each rank computes its own rows);
        features must be whole and values fully reduced. Expert-parallel outputs are marked
        token-sharded over the expert group (each rank holds the rows of its experts).
        """
        if sharding.features:
            raise PartitionError(
                f"{self.describe()}: its input is sharded on features (the output of a column-parallel "
                f"Linear); a grouped GEMM needs all {self.in_features} input features per token: gather "
                f"them first or use a row-parallel layer before it")
        if sharding.partial:
            raise PartitionError(
                f"{self.describe()}: its input is a partial sum (a row-parallel GEMM before its "
                f"reduction); put an AllReduce/ReduceScatter before the grouped GEMM")
        out = sharding
        if self.parallel in ("expert", "expert+fsdp") and self.expert_world > 1:
            out = Sharding(tokens=True, group=self.expert_group if self.expert_group is not None
                           else groups.resolve(None, "GroupedLinear"))
        return [self.basic_op()], (out if not out.replicated else REPLICATED)

    # Reference ---------------------------------------------------------------------------------

    def forward(self, x, group_sizes):
        self.infer_meta(TensorMeta.of(x), TensorMeta.of(group_sizes))  # errors that name this layer
        self._refuse_forced_implementation()
        return self.basic_op()(x, group_sizes)

    def _refuse_forced_implementation(self) -> None:
        """A direct call runs the reference math, never the fused op ``grouped_linear``: a forced
        implementation of that op (other than ``reference``) cannot run here, and a silent
        reference run would benchmark or test the wrong thing. Raised as a compiled block raises
        for a forced implementation that cannot run."""
        forced = parse_force_impl(config.force_impl).get(_FUSED_OP)
        if forced is None or forced == "reference":
            return
        raise ImplementationError(
            f"{_FUSED_OP}: forced implementation {forced!r} cannot run: {self.describe()} called directly runs its "
            f"reference math (torch ops, group sizes read on the host), not the fused op; call it inside a block, "
            f"ops.Sequential(layer)(x, group_sizes) or opfuse.compile(layer, x, group_sizes), to run {forced!r}, "
            f"or force 'reference' (OPFUSE_FORCE_IMPL / opfuse.config.force_impl={config.force_impl!r})")

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        # Validate under this op's own name (the user's layer), with the local group count.
        return _infer_meta(self, x, extra, self.local_num_groups, self.out_features)
