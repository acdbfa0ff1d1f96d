"""Reusable predicates for rule patterns (public: use them in your own rules).

Op-level predicates receive a :class:`~opfuse.passes.rule.MatchedOp`; rule-level ones a
:class:`~opfuse.passes.rule.Match`. Each returns ``True`` or a reason string.
"""

from __future__ import annotations

from ..ops import group as groups
from ..ops.base import dtype_name
from .pattern import predicate
from .rule import Match

__all__ = ["norm_params_match_input", "bias_matches_input", "one_group"]


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
