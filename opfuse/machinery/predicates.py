"""Reusable predicates for rule patterns (public: use them in your own rules).

Op-level predicates receive a :class:`~opfuse.machinery.rule.MatchedOp`; rule-level ones a
:class:`~opfuse.machinery.rule.Match`. Each returns ``True`` or a reason string.
"""

from __future__ import annotations

from ..ops import group as groups
from ..ops.base import dtype_name
from .pattern import predicate
from .rule import Match

__all__ = ["norm_params_match_input", "bias_matches_input", "one_group", "not_fp8", "is_fp8", "quantize_fits_gemm",
           "quantize_fits_gather", "gathered_fp8_scale_shared", "moves_a_gradient", "not_quantized"]


@predicate("norm parameters have the activation dtype")
def norm_params_match_input(matched) -> bool | str:
    dtype = matched.input_metas[0].dtype
    for name in ("weight", "bias"):
        param = getattr(matched.op, name, None)
        if param is not None and param.dtype != dtype:
            return f"{name} is {dtype_name(param.dtype)}, input is {dtype_name(dtype)}"
    return True


@predicate("bias has the activation dtype")
def bias_matches_input(matched) -> bool | str:
    dtype = matched.input_metas[0].dtype
    if matched.op.bias.dtype != dtype:
        return f"bias is {dtype_name(matched.op.bias.dtype)}, input is {dtype_name(dtype)}"
    return True


@predicate("all collectives use one process group")
def one_group(match: Match) -> bool | str:
    names = {groups.group_name(m.op.group) for m in match.ops.values() if getattr(m.op, "is_collective", False)}
    return True if len(names) <= 1 else f"groups {sorted(names)}"


@predicate("the GEMM is not FP8")
def not_fp8(matched) -> bool | str:
    recipe = getattr(matched.op, "recipe", None)
    return True if recipe is None else f"FP8 GEMM ({recipe.describe()}); the FP8 rules fuse it"


@predicate("the GEMM is FP8")
def is_fp8(matched) -> bool | str:
    return True if getattr(matched.op, "recipe", None) is not None else "not an FP8 GEMM (no fp8.autocast)"


@predicate("the Quantize is the GEMM's own input quantization")
def quantize_fits_gemm(match: Match) -> bool | str:
    quantize, gemm = match.get("quantize"), match.get("linear")
    if quantize is None or gemm is None:
        return True
    q, recipe = quantize.op, gemm.op.recipe
    if q.amax_group is not None:
        return "its amax is shared over a group (it feeds an all-gather)"
    if q.dtype != recipe.forward_dtype or q.rowwise != recipe.rowwise:
        return f"Quantize({q.extra_repr()}) differs from the GEMM's {recipe.describe()}"
    return True


def _recipe_mismatch(q, recipe) -> str | None:
    if q.dtype != recipe.forward_dtype or q.rowwise != recipe.rowwise:
        return f"Quantize({q.extra_repr()}) differs from the GEMM's {recipe.describe()}"
    return None


@predicate("the Quantize feeds the all-gather as the GEMM expects")
def quantize_fits_gather(match: Match) -> bool | str:
    quantize = match.get("quantize")
    if quantize is None:
        return True
    q, recipe = quantize.op, match["linear"].op.recipe
    reason = _recipe_mismatch(q, recipe)
    if reason:
        return reason
    group = match["gather"].op.group
    if not q.rowwise and (q.amax_group is None or not groups.same_group(q.amax_group, group)):
        return "one scale per rank's shard: the gathered tensor would not have one scale (amax not shared)"
    return True


@predicate("an FP8 input to the all-gather shares one scale over its group")
def gathered_fp8_scale_shared(match: Match) -> bool | str:
    if "quantize" in match:
        return True
    gather = match["gather"]
    source = gather.node.args[0]
    tag = source.meta["opfuse_meta"].quantized
    if tag is None or tag.endswith("/row"):
        return True
    producer = source.args[0] if source.op == "call_function" else source
    module = producer.graph.owning_module.get_submodule(producer.target) if producer.op == "call_module" else None
    amax_group = getattr(module, "amax_group", None)
    if amax_group is None or not groups.same_group(amax_group, gather.op.group):
        return "its producer quantized each rank's shard with its own scale"
    return True


@predicate("the op's input is a gradient (the backward part of a joint forward + backward graph)")
def moves_a_gradient(matched) -> bool | str:
    """``True`` when the op depends on one of a joint graph's ``tangents`` inputs (the incoming
    gradients torch.compile's AOTAutograd names so); graphs without them have no backward part."""
    seen, stack = set(), [matched.node]
    while stack:
        node = stack.pop()
        if node.op == "placeholder" and node.name.startswith("tangents"):
            return True
        for arg in node.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                stack.append(arg)
    return "a forward op (its input depends on no incoming gradient)"


@predicate("the input is not FP8")
def not_quantized(matched) -> bool | str:
    tag = matched.input_metas[0].quantized
    return True if tag is None else f"FP8 input ({tag})"
