"""The partition pass: expand composite ops into basic ops plus the collectives their partition
rules require, annotating every new value with its layout.

The rules themselves live with the ops (``Linear.expand`` applies
:func:`opfuse.ops.sharding.plan_gemm`; each basic op's ``propagate_sharding`` says how it
transforms a layout). Lowering already annotated and validated every value's layout
(``node.meta["opfuse_sharding"]``), so this pass only rewrites. It also marks parameters applied
to token-sharded activations, whose gradients are per-rank partial sums.
"""

from __future__ import annotations

from torch import fx

from ...ops.base import BasicOp, output_meta
from ...ops.expansion import Step, evaluate
from ...ops.sharding import Sharding
from .fp8 import insert_fp8
from ...machinery.rewrite import add_submodule, snake_case

__all__ = ["partition"]


def _mark_sequence_parallel_params(op: BasicOp, sharding: Sharding) -> None:
    """Parameters applied to token-sharded activations get gradients from this rank's tokens only
    (a partial sum over the group). Mark them, as Megatron-LM does, so
    :func:`opfuse.sync_sequence_parallel_grads` can all-reduce them before the optimizer step."""
    if not sharding.tokens:
        return
    for param in op.parameters(recurse=False):
        param.sequence_parallel = True
        param.sequence_parallel_group = sharding.group


def _expand(gm: fx.GraphModule, node: fx.Node, op: BasicOp) -> None:
    graph = gm.graph
    src = node.args[0]
    expanded, out = op.expand(src.meta["opfuse_sharding"])
    path = node.meta.get("opfuse_path", node.name)

    def add(step: Step, args: list, taken: list) -> fx.Node:
        basic, label = step.op, step.name or snake_case(step.op.kind)
        name = add_submodule(gm, f"{node.target}_{label}", basic)
        inputs = [*args, *taken]
        value = graph.call_module(name, tuple(inputs))
        value.meta["opfuse_meta"] = output_meta(basic, *(a.meta["opfuse_meta"] for a in inputs))
        value.meta["opfuse_path"] = f"{path}.{label}"
        shardings = [a.meta["opfuse_sharding"] for a in inputs]
        value.meta["opfuse_sharding"] = basic.propagate_sharding(*shardings)
        _mark_sequence_parallel_params(basic, shardings[0])
        return value

    with graph.inserting_before(node):
        # Extra inputs of the composite go to the expanded ops that declare them, in order.
        value = evaluate(expanded, src, list(node.args[1:]), add)
    value.meta["opfuse_sharding"] = out
    node.replace_all_uses_with(value)
    graph.erase_node(node)
    gm.delete_submodule(node.target)


def partition(gm: fx.GraphModule, ctx) -> None:
    """Expand composites; mark sequence-parallel parameters; under :func:`opfuse.fp8.autocast`,
    make the GEMMs FP8 and quantize their inputs (:func:`.fp8.insert_fp8`: the partitioned program
    is then the unfused FP8 program, what fusion passes and rules start from)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        op = gm.get_submodule(node.target)
        if getattr(op, "is_composite", False):
            _expand(gm, node, op)
        else:
            _mark_sequence_parallel_params(op, node.args[0].meta["opfuse_sharding"])
    insert_fp8(gm, ctx)
