"""Partition rules: expanding composite ops into basic ops and inserting collectives.

The rules for a sharded GEMM ``LHS [M, K] x RHS [K, N]`` (``RHS`` is the weight, stored ``[N, K]``;
any batch dims of the activation are carried along with M and keep their partitioning):

1. RHS sharded on both K and N: an error (no 1-D tensor-parallel layout does that).
2. LHS sharded on M (sequence parallel) and the GEMM sharded: all-gather LHS along M.
3. K of LHS follows K of RHS: RHS K-sharded and LHS not -> take this rank's slice of LHS's
   features; LHS K-sharded and RHS not -> an error.
4. RHS N-sharded and LHS replicated: the gradient of LHS is a partial sum -> ``GradAllReduce``.
5. K sharded: the output is a partial sum -> all-reduce it, or reduce-scatter it along M when
   the layer is sequence parallel (M and K sharded). A row-parallel bias follows the reduction.

Every graph value is annotated with its :class:`~opfuse.ops.Sharding` (``node.meta["opfuse_sharding"]``)
so later passes and errors can say how a value is laid out.
"""

from __future__ import annotations

from torch import fx

from ..ops import collectives as coll
from ..ops import group as groups
from ..ops.activation import GELU, SwiGLU
from ..ops.base import BasicOp, OpInputError
from ..ops.extra import AddExtraInput
from ..ops.linear import BasicLinear, Bias, Linear
from ..ops.norm import _Norm
from ..ops.sharding import REPLICATED, Sharding
from .rewrite import add_submodule, snake_case

__all__ = ["PartitionError", "plan_gemm", "plan_linear", "partition"]


class PartitionError(OpInputError):
    """A sharding combination the partition rules do not allow."""


def _same(a, b) -> bool:
    return groups.same_group(a, b)  # None is the default group, resolved by name


def plan_gemm(lhs: Sharding, rhs_k: bool, rhs_n: bool, sequence_parallel: bool, who: str = "GEMM"):
    """Apply the sharded-GEMM rules. Returns ``(pre, reduce, out)``: collective kinds applied to
    LHS before the GEMM (``"all_gather"``, ``"split_features"``, ``"grad_all_reduce"``), the
    reduction of the output (``None``, ``"all_reduce"``, ``"reduce_scatter"``), and the
    output sharding flags ``(tokens, features)``."""
    if rhs_k and rhs_n:
        raise PartitionError(
            f"{who}: the weight is sharded on both K (in_features) and N (out_features); 1-D tensor "
            f"parallelism shards one of them (parallel='row' for K, 'column' for N)"
        )
    if lhs.partial:
        raise PartitionError(f"{who}: its input is a partial sum; reduce it (AllReduce) before the GEMM")
    sharded = rhs_k or rhs_n
    pre = []
    tokens = lhs.tokens
    if lhs.tokens and sharded:
        pre.append("all_gather")
        tokens = False
    if lhs.features and not rhs_k:
        raise PartitionError(
            f"{who}: its input is sharded on features (K) but the weight is not sharded on K; "
            f"use parallel='row' for a layer that follows a column-parallel one"
        )
    if rhs_k and not lhs.features:
        pre.append("split_features")
    if rhs_n and not lhs.tokens:
        pre.append("grad_all_reduce")
    reduce = None
    if rhs_k:
        reduce = "reduce_scatter" if sequence_parallel else "all_reduce"
        tokens = sequence_parallel
    return pre, reduce, (tokens, rhs_n)


def plan_linear(linear: Linear, sharding: Sharding) -> tuple[list[BasicOp], Sharding]:
    """Basic ops for ``linear`` given its input's sharding, and the output's sharding."""
    group = linear.group
    if linear.parallel is None:
        if sharding.features:
            raise PartitionError(
                f"{linear.describe()}: its input is sharded on features but the layer is not "
                f"parallel; use parallel='row'"
            )
        ops: list[BasicOp] = [BasicLinear(linear.in_features, linear.out_features, weight=linear.weight)]
        if linear.bias is not None:
            ops.append(Bias(linear.out_features, bias=linear.bias))
        return ops, Sharding(tokens=sharding.tokens, group=sharding.group) if sharding.tokens else REPLICATED
    if not sharding.replicated and not _same(sharding.group, group):
        raise PartitionError(
            f"{linear.describe()}: its input is sharded over process group "
            f"{groups.group_name(sharding.group)!r} but the layer is parallel over "
            f"{groups.group_name(group)!r}"
        )
    pre, reduce, (tokens, features) = plan_gemm(
        sharding, rhs_k=linear.parallel == "row", rhs_n=linear.parallel == "column",
        sequence_parallel=linear.sequence_parallel, who=linear.describe())
    ops = []
    for kind in pre:
        ops.append({"all_gather": coll.AllGather, "split_features": coll.SplitFeatures,
                    "grad_all_reduce": coll.GradAllReduce}[kind](group))
    ops.append(BasicLinear(linear.local_in_features, linear.local_out_features, weight=linear.weight,
                           weight_sharding="in" if linear.parallel == "row" else "out"))
    if reduce == "all_reduce":
        ops.append(coll.AllReduce(group))
    elif reduce == "reduce_scatter":
        ops.append(coll.ReduceScatter(group))
    if linear.bias is not None:
        ops.append(Bias(linear.bias.shape[0], bias=linear.bias))
    out = Sharding(tokens=tokens, features=features, group=group) if (tokens or features) else REPLICATED
    return ops, out


def _propagate(op: BasicOp, sharding: Sharding, node: fx.Node) -> Sharding:
    """Sharding after a non-composite op, with errors for layouts the op cannot work on."""
    if isinstance(op, _Norm):
        if sharding.features:
            raise PartitionError(
                f"{op.describe()} ({node.name}): its input is sharded on features (the output of a "
                f"column-parallel Linear); a norm needs the full hidden dim"
            )
        if sharding.partial:
            raise PartitionError(f"{op.describe()} ({node.name}): its input is a partial sum; reduce it first")
        return sharding
    if isinstance(op, (GELU, SwiGLU, AddExtraInput, Bias)) and sharding.partial:
        raise PartitionError(
            f"{op.describe()} ({node.name}): its input is a partial sum (a row-parallel GEMM output "
            f"before its reduction); put the op after the AllReduce/ReduceScatter"
        )
    if isinstance(op, coll.AllReduce):
        return Sharding(tokens=True, group=sharding.group) if sharding.tokens else REPLICATED
    if isinstance(op, coll.ReduceScatter):
        return Sharding(tokens=True, group=op.group)
    if isinstance(op, coll.GradAllReduce):
        return sharding
    if isinstance(op, coll.AllGather):
        return Sharding(features=sharding.features, group=sharding.group) if sharding.features else REPLICATED
    if isinstance(op, coll.SplitFeatures):
        return Sharding(tokens=sharding.tokens, features=True, group=op.group)
    if isinstance(op, BasicLinear):
        if op.weight_sharding == "in":
            return Sharding(tokens=sharding.tokens, partial=True, group=sharding.group)
        if op.weight_sharding == "out":
            return Sharding(tokens=sharding.tokens, features=True, group=sharding.group)
        # A user-declared local GEMM: its weight layout is unknown, keep the token layout.
        return Sharding(tokens=True, group=sharding.group) if sharding.tokens else REPLICATED
    return sharding


def _mark_sequence_parallel_params(op: BasicOp, sharding: Sharding) -> None:
    """Parameters applied to token-sharded activations get gradients from this rank's tokens only
    (a partial sum over the group). Mark them, as Megatron-LM does, so
    :func:`opfuse.sync_sequence_parallel_grads` can all-reduce them before the optimizer step."""
    if not sharding.tokens:
        return
    for param in op.parameters(recurse=False):
        param.sequence_parallel = True
        param.sequence_parallel_group = sharding.group


def input_sharding(ops: list[BasicOp], metas) -> Sharding:
    """Layout of the block input: what its first parallel Linear expects."""
    for op, meta in zip(ops, metas):
        if isinstance(op, Linear) and op.parallel is not None:
            return op.natural_input_sharding(meta)
        if isinstance(op, (coll.AllGather,)):
            return Sharding(tokens=True, group=op.group)
    return REPLICATED


def partition(gm: fx.GraphModule, ctx) -> None:
    """The partition pass: annotate shardings, expand composites, insert collectives."""
    graph = gm.graph
    chain = [n for n in graph.nodes if n.op == "call_module"]
    ops = [gm.get_submodule(n.target) for n in chain]
    metas = [n.args[0].meta["opfuse_meta"] for n in chain]
    start = input_sharding(ops, metas)
    for node in graph.nodes:
        if node.op == "placeholder":
            node.meta["opfuse_sharding"] = start
    for node in chain:
        op = gm.get_submodule(node.target)
        src = node.args[0]
        sharding = src.meta["opfuse_sharding"]
        if getattr(op, "is_composite", False):
            # Composite ops expand through their own partition rules (Linear: plan_linear).
            expanded, out = op.expand(sharding)
            value = src
            meta = src.meta["opfuse_meta"]
            extras = list(node.args[1:])
            path = node.meta.get("opfuse_path", node.name)
            with graph.inserting_before(node):
                for basic in expanded:
                    name = add_submodule(gm, f"{node.target}_{snake_case(basic.kind)}", basic)
                    # Extra inputs of the composite go to the expanded ops that declare them, in order.
                    taken = [extras.pop(0) for _ in range(basic.num_extra_inputs)]
                    value = graph.call_module(name, (value, *taken))
                    meta = basic.infer_meta(meta, *(t.meta["opfuse_meta"] for t in taken))
                    value.meta["opfuse_meta"] = meta
                    value.meta["opfuse_path"] = f"{path}.{snake_case(basic.kind)}"
                    inner = value.args[0].meta["opfuse_sharding"]
                    value.meta["opfuse_sharding"] = _propagate(basic, inner, value)
                    _mark_sequence_parallel_params(basic, inner)
            value.meta["opfuse_sharding"] = out
            node.replace_all_uses_with(value)
            graph.erase_node(node)
            gm.delete_submodule(node.target)
            continue
        out = _propagate(op, sharding, node)
        _mark_sequence_parallel_params(op, sharding)
        for extra in node.args[1:]:
            if isinstance(extra, fx.Node) and extra.op == "placeholder":
                extra.meta["opfuse_sharding"] = sharding
        node.meta["opfuse_sharding"] = out
