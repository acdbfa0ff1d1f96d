"""Linear layers: the local GEMM (:class:`BasicLinear`), :class:`Bias`, and the tensor-parallel
composite :class:`Linear` that the partition pass expands into them plus collectives (the rules
of :func:`~opfuse.ops.sharding.plan_gemm`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..fp8.linear import fp8_linear
from ..fp8.recipe import Recipe
from . import collectives as coll
from . import group as groups
from .base import BasicOp, OpInputError, PartitionError, TensorMeta, check_size
from .sharding import REPLICATED, Sharding, plan_gemm, reject_partial

__all__ = ["BasicLinear", "Bias", "Linear"]

_PARALLEL_MODES = (None, "column", "row")


#: The collective op of each kind :func:`~opfuse.ops.sharding.plan_gemm` asks for before a GEMM.
_INPUT_COLLECTIVES = {"all_gather": coll.AllGather, "split_features": coll.SplitFeatures,
                      "tokens_to_features": coll.TokensToFeatures, "grad_all_reduce": coll.GradAllReduce}


def gemm_input_plan(layer, sharding: Sharding, *, rhs_k: bool, rhs_n: bool):
    """For a tensor-parallel GEMM layer (``layer.group``, ``layer.sequence_parallel``) whose input
    is laid out as ``sharding``: ``(collective ops before the GEMM, reduction of its output,
    (tokens, features) of the output)`` from :func:`~opfuse.ops.sharding.plan_gemm`, after checking
    that a sharded input is sharded over the layer's own group."""
    if not sharding.replicated and not groups.same_group(sharding.group, layer.group):
        raise PartitionError(
            f"{layer.describe()}: its input is sharded over process group {groups.group_name(sharding.group)!r} "
            f"but the layer is parallel over {groups.group_name(layer.group)!r}")
    pre, reduce, out = plan_gemm(sharding, rhs_k=rhs_k, rhs_n=rhs_n, sequence_parallel=layer.sequence_parallel,
                                 who=layer.describe())
    return [_INPUT_COLLECTIVES[kind](layer.group) for kind in pre], reduce, out


def check_group_unchanged(layer, who: str) -> None:
    """Raise :class:`~opfuse.ops.group.GroupError` when a parallel layer's group no longer gives
    this process the rank and world size the layer was built (and sharded) for."""
    if layer.parallel:
        world, rank = groups.world_size(layer.group, who), groups.rank(layer.group, who)
        if (world, rank) != (layer.world_size, layer.rank):
            raise groups.GroupError(
                f"{layer.describe()}: built as rank {layer.rank} of {layer.world_size} of its process group, which "
                f"now has this process as rank {rank} of {world} (was the process group re-created?); build the "
                f"layer again for the new group")


def _init_weight_(weight: torch.Tensor, fan_in: int) -> None:
    # nn.Linear's default (kaiming_uniform with a=sqrt(5)) computed from the *global* fan-in,
    # so a sharded layer starts with the same distribution as its unsharded twin.
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    with torch.no_grad():
        weight.uniform_(-bound, bound)


class BasicLinear(BasicOp):
    """``y = x @ weight.T (+ bias)`` on the local shard, no communication.

    Parameters
    ----------
    in_features, out_features:
        Local sizes (``weight`` is ``[out_features, in_features]``).
    weight:
        An existing parameter to use instead of creating one (the partition pass builds the
        BasicLinear of a :class:`Linear` around the Linear's own parameter).
    weight_sharding:
        ``None``, ``"in"`` (this is a K-shard of a row-parallel weight: the output is a partial
        sum) or ``"out"`` (an N-shard of a column-parallel weight). Set by the partition pass.
    recipe:
        An :mod:`opfuse.fp8` recipe: the GEMM runs on FP8 operands (forward, data gradient and,
        per recipe, weight gradient; the reference emulates them in float32). Set by the FP8 pass
        under :func:`opfuse.fp8.autocast`.
    bias:
        A bias parameter added inside the GEMM (one rounding of ``x @ W.T + b``; programs fold a
        ``Bias`` that follows a GEMM into it). Not with ``weight_sharding="in"``: a partial sum
        takes its bias after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, *, device=None, dtype=None,
                 weight: nn.Parameter | None = None, fan_in: int | None = None,
                 weight_sharding: str | None = None, recipe: Recipe | None = None,
                 bias: nn.Parameter | None = None):
        super().__init__()
        if recipe is not None and not isinstance(recipe, Recipe):
            raise ValueError(f"BasicLinear: recipe={recipe!r}; expected an opfuse.fp8 recipe or None")
        self.recipe = recipe
        if weight_sharding not in (None, "in", "out"):
            raise ValueError(f"BasicLinear: weight_sharding={weight_sharding!r}; accepted: None, 'in', 'out'")
        if bias is not None and weight_sharding == "in":
            raise ValueError("BasicLinear: a bias inside a row-parallel (weight_sharding='in') GEMM would be added "
                             "once per rank; add it after the reduction")
        self.weight_sharding = weight_sharding
        # >= 0, as torch.nn.Linear: a graph traced from a model may hold an empty GEMM.
        self.in_features = in_features = check_size(in_features, "BasicLinear", "in_features", 0)
        self.out_features = out_features = check_size(out_features, "BasicLinear", "out_features", 0)
        if weight is None:
            weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
            _init_weight_(weight, fan_in or in_features)
        elif tuple(weight.shape) != (out_features, in_features):
            raise OpInputError(
                f"BasicLinear: weight has shape {list(weight.shape)}, expected "
                f"[{out_features}, {in_features}]"
            )
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise OpInputError(f"BasicLinear: bias has shape {list(bias.shape)}, expected [{out_features}]")
        self.weight = weight
        self.bias = bias

    def extra_repr(self) -> str:
        text = f"in_features={self.in_features}, out_features={self.out_features}"
        text += f", weight_sharding={self.weight_sharding!r}" if self.weight_sharding else ""
        text += f", fp8={self.recipe.describe()}" if self.recipe is not None else ""
        return text + (", bias" if self.bias is not None else "")

    def with_recipe(self, recipe: Recipe | None) -> "BasicLinear":
        """The same GEMM (sharing the weight and bias) with FP8 ``recipe``."""
        return BasicLinear(self.in_features, self.out_features, weight=self.weight,
                           weight_sharding=self.weight_sharding, recipe=recipe, bias=self.bias)

    def forward(self, x):
        if self.recipe is not None:
            return fp8_linear(x, self.weight, self.bias, self.recipe)
        return F.linear(x, self.weight, self.bias)

    def propagate_sharding(self, x: Sharding, *extra) -> Sharding:
        """``"in"`` (a K-shard of a row-parallel weight): a partial sum; ``"out"`` (an N-shard of a
        column-parallel weight): sharded features; a local GEMM keeps the token layout and needs
        whole, reduced features."""
        reject_partial(self, x)
        if self.weight_sharding == "in":
            return Sharding(tokens=x.tokens, partial=True, group=x.group)
        if self.weight_sharding == "out":
            return Sharding(tokens=x.tokens, features=True, group=x.group)
        if x.features:
            raise PartitionError(
                f"{self.describe()}: its input is sharded on features but this local GEMM's weight holds all "
                f"{self.in_features} input features; use Linear(parallel='row') after a column-parallel layer")
        return x

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        self._require_float(x)
        self._require_features(x, self.in_features)
        self._require_param_match(x, [self.weight, self.bias])
        return x.with_(shape=x.shape[:-1] + (self.out_features,),
                       requires_grad=x.requires_grad or self.weight.requires_grad
                       or (self.bias is not None and self.bias.requires_grad))


class Bias(BasicOp):
    """``y = x + bias`` over the last dim."""

    def __init__(self, features: int, *, device=None, dtype=None, bias: nn.Parameter | None = None):
        super().__init__()
        self.features = features = check_size(features, "Bias", "features", 0)
        if bias is None:
            bias = nn.Parameter(torch.zeros(features, device=device, dtype=dtype))
        elif tuple(bias.shape) != (features,):
            raise OpInputError(f"Bias: parameter has shape {list(bias.shape)}, expected [{features}]")
        self.bias = bias

    def extra_repr(self) -> str:
        return f"features={self.features}"

    def forward(self, x):
        return x + self.bias

    def propagate_sharding(self, x: Sharding, *extra) -> Sharding:
        """Elementwise over features (the parameter is this rank's slice of a column-parallel
        bias when the features are sharded); a partial sum would add the bias once per rank."""
        reject_partial(self, x)
        return x

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        self._require_float(x)
        self._require_features(x, self.features)
        self._require_param_match(x, [self.bias])
        return x.with_(requires_grad=x.requires_grad or self.bias.requires_grad)


class Linear(BasicOp):
    """A (tensor-parallel) linear layer ``y = x @ W.T + b`` with *global* feature sizes.

    Parameters
    ----------
    in_features, out_features:
        Global sizes of the unsharded layer.
    bias:
        Add a bias. A row-parallel bias is added once, after the reduction.
    parallel:
        ``None`` (not sharded), ``"column"`` (``weight`` is ``[out/world, in]``, output sharded on
        features) or ``"row"`` (``weight`` is ``[out, in/world]``, input sharded on features, output
        summed over ranks).
    sequence_parallel:
        Tokens (dim 0) are sharded outside the layer: a column layer all-gathers its input, a row
        layer reduce-scatters its output.
    group:
        The tensor-parallel ``ProcessGroup``; ``None`` means the default group.

    Examples
    --------
    >>> fc2 = ops.Linear(28672, 8192, parallel="row", group=tp)        # doctest: +SKIP
    >>> fc2.load_unsharded(full_weight, full_bias)                     # doctest: +SKIP
    """

    is_composite = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True, parallel=None,
                 sequence_parallel: bool = False, group=None, device=None, dtype=None):
        super().__init__()
        if parallel not in _PARALLEL_MODES:
            raise ValueError(f"Linear: parallel={parallel!r}; accepted: None, 'column', 'row'")
        if sequence_parallel and parallel is None:
            raise ValueError("Linear: sequence_parallel=True needs parallel='column' or 'row'")
        in_features = check_size(in_features, "Linear", "in_features")
        out_features = check_size(out_features, "Linear", "out_features")
        for name, value in (("bias", bias), ("sequence_parallel", sequence_parallel)):
            if not isinstance(value, bool):
                raise TypeError(f"Linear: {name}={value!r}; expected True or False")
        self.in_features = in_features
        self.out_features = out_features
        self.parallel = parallel
        self.sequence_parallel = bool(sequence_parallel)
        self.group = groups.check(group, "Linear")
        world = groups.world_size(group, "Linear") if parallel else 1
        self.world_size = world
        self.rank = groups.rank(group, "Linear") if parallel else 0
        local_in, local_out = in_features, out_features
        if parallel == "column":
            local_out = self._divide(out_features, world, "out_features")
        elif parallel == "row":
            local_in = self._divide(in_features, world, "in_features")
        self.weight = nn.Parameter(torch.empty(local_out, local_in, device=device, dtype=dtype))
        _init_weight_(self.weight, in_features)
        if bias:
            bias_features = local_out if parallel == "column" else out_features
            self.bias = nn.Parameter(torch.zeros(bias_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self._expansions: dict[tuple[Sharding, int], tuple[list[BasicOp], Sharding]] = {}

    def _divide(self, size: int, world: int, name: str) -> int:
        if size % world:
            raise ValueError(
                f"Linear(parallel={self.parallel!r}): {name}={size} is not divisible by the world "
                f"size {world}"
            )
        return size // world

    def extra_repr(self) -> str:
        text = f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        if self.parallel:
            text += f", parallel={self.parallel!r}, world={self.world_size}"
        if self.sequence_parallel:
            text += ", sequence_parallel=True"
        return text

    # Sharding ---------------------------------------------------------------------------

    @property
    def local_in_features(self) -> int:
        return self.in_features // self.world_size if self.parallel == "row" else self.in_features

    @property
    def local_out_features(self) -> int:
        return self.out_features // self.world_size if self.parallel == "column" else self.out_features

    def process_groups(self) -> list:
        return [self.group] if self.parallel else []

    def check_state(self) -> None:
        """Raise if the layer no longer matches what it was built for: its group changed size (a
        re-created process group) or a parameter was replaced by one of another shape."""
        check_group_unchanged(self, "Linear")
        local = (self.local_out_features, self.local_in_features)
        if tuple(self.weight.shape) != local:
            shard = f" (this rank's shard of [{self.out_features}, {self.in_features}])" if self.parallel else ""
            raise OpInputError(f"{self.describe()}: weight has shape {list(self.weight.shape)}, expected "
                               f"{list(local)}{shard}")
        if self.bias is not None:
            features = self.local_out_features if self.parallel == "column" else self.out_features
            if tuple(self.bias.shape) != (features,):
                raise OpInputError(f"{self.describe()}: bias has shape {list(self.bias.shape)}, expected [{features}]")

    def natural_input_sharding(self, x: TensorMeta | None = None) -> Sharding | None:
        """The layout this layer expects of its input when nothing upstream says otherwise
        (``None`` for a layer that is not parallel: it takes what it is given)."""
        if self.parallel is None:
            return None
        if self.parallel == "column":
            return Sharding(tokens=self.sequence_parallel, group=self.group)
        # Row: a column-parallel activation (sharded features) unless the caller passes the
        # full width, in which case the partition rules slice it locally.
        if x is not None and self.world_size > 1 and x.features == self.in_features:
            return REPLICATED
        return Sharding(features=True, group=self.group)

    def check_input(self, x: TensorMeta, sharding: Sharding) -> None:
        """Raise :class:`OpInputError` when a row-parallel layer's input width does not fit its
        layout, naming both widths the layer takes (its local GEMM would name only its shard)."""
        if self.parallel != "row" or self.world_size == 1 or len(x.shape) < 1:
            return  # the local GEMM's own message names the one accepted width
        shard, full = self.local_in_features, self.in_features
        if sharding.features and x.features != shard:
            raise OpInputError(f"{self.describe()}: input has {x.features} features (last dim of shape "
                               f"{list(x.shape)}); expected {shard} (this rank's shard of in_features={full}, e.g. "
                               f"a column-parallel layer's output) or {full} (a replicated value: the layer keeps "
                               f"its shard)")
        if not sharding.features and x.features != full:
            raise OpInputError(f"{self.describe()}: input is {sharding.describe()} with {x.features} features (last "
                               f"dim of shape {list(x.shape)}); expected all {full} (a shard of {shard} features is "
                               f"what a column-parallel layer outputs)")

    def expand(self, sharding: Sharding) -> tuple[list[BasicOp], Sharding]:
        """Basic ops equivalent to this layer for an input laid out as ``sharding`` (collectives
        from :func:`~opfuse.ops.sharding.plan_gemm`, the local GEMM, the bias), and the layout of
        the result."""
        self.check_state()
        group = self.group
        if self.parallel is None:
            if sharding.features:
                raise PartitionError(
                    f"{self.describe()}: its input is sharded on features but the layer is not parallel; use "
                    f"parallel='row'")
            reject_partial(self, sharding)
            ops: list[BasicOp] = [BasicLinear(self.in_features, self.out_features, weight=self.weight)]
            if self.bias is not None:
                ops.append(Bias(self.out_features, bias=self.bias))
            return ops, sharding
        ops, reduce, (tokens, features) = gemm_input_plan(self, sharding, rhs_k=self.parallel == "row",
                                                          rhs_n=self.parallel == "column")
        ops.append(BasicLinear(self.local_in_features, self.local_out_features, weight=self.weight,
                               weight_sharding="in" if self.parallel == "row" else "out"))
        if reduce == "all_reduce":
            ops.append(coll.AllReduce(group))
        elif reduce == "reduce_scatter":
            ops.append(coll.ReduceScatter(group))
        if self.bias is not None:
            ops.append(Bias(self.bias.shape[0], bias=self.bias))
        out = Sharding(tokens=tokens, features=features, group=group) if (tokens or features) else REPLICATED
        return ops, out

    def load_unsharded(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's shard of the full ``weight [out, in]`` (and ``bias [out]``)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"Linear.load_unsharded: weight has shape {list(weight.shape)}, expected "
                f"[{self.out_features}, {self.in_features}]"
            )
        rows, cols = self.local_out_features, self.local_in_features
        with torch.no_grad():
            if self.parallel == "column":
                self.weight.copy_(weight[self.rank * rows:(self.rank + 1) * rows])
            elif self.parallel == "row":
                self.weight.copy_(weight[:, self.rank * cols:(self.rank + 1) * cols])
            else:
                self.weight.copy_(weight)
            if bias is not None:
                if self.bias is None:
                    raise ValueError("Linear.load_unsharded: got a bias but the layer has bias=False")
                if tuple(bias.shape) != (self.out_features,):
                    raise ValueError(
                        f"Linear.load_unsharded: bias has shape {list(bias.shape)}, expected "
                        f"[{self.out_features}]"
                    )
                if self.parallel == "column":
                    self.bias.copy_(bias[self.rank * rows:(self.rank + 1) * rows])
                else:
                    self.bias.copy_(bias)

    # Reference ----------------------------------------------------------------------------

    def forward(self, x):
        meta = TensorMeta.of(x)
        ops, _ = self._expansion(self.natural_input_sharding(meta) or REPLICATED)
        for op in ops:
            x = op(x)
        return x

    def _expansion(self, sharding: Sharding):
        # Keyed on the op's version: a replaced parameter or a new group needs a new expansion.
        key = (sharding, self._op_version)
        found = self._expansions.get(key)
        if found is None:
            for stale in [k for k in self._expansions if k[1] != self._op_version]:
                del self._expansions[stale]
            found = self._expansions[key] = self.expand(sharding)
        return found

    def infer_meta(self, x: TensorMeta, *extra: TensorMeta) -> TensorMeta:
        """Metadata for an input in the layer's natural layout (lowering uses :meth:`expand` with
        the actual layout instead)."""
        ops, _ = self._expansion(self.natural_input_sharding(x) or REPLICATED)
        for op in ops:
            x = op.infer_meta(x)
        return x
