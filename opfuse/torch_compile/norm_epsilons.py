"""Norm epsilons that Dynamo passed as graph inputs, made constants again.

Under ``dynamic=True`` (or once a float changed between calls) Dynamo passes a Python float it
reads, such as Hugging Face's ``RMSNorm.variance_epsilon``, as a graph input (a float64 scalar
tensor read with ``.item()``) instead of a constant. A norm whose epsilon is a tensor matches no
norm rule, so every RMSNorm of such a model would be left unfused. :func:`specialize_norm_epsilons`
finds those inputs and has Dynamo trace the frame again with them as constants.
"""

from __future__ import annotations

import operator

import torch

__all__ = ["specialize_norm_epsilons"]


def _is_item(node: torch.fx.Node) -> bool:
    return node.op == "call_method" and node.target == "item"


_ADDS = {operator.add, torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
_RSQRTS = {torch.rsqrt, torch.Tensor.rsqrt}


def _is_norm_epsilon(item: torch.fx.Node) -> bool:
    """``item`` (a float's value) is added to a value whose reciprocal square root is taken: a
    norm's epsilon (``rsqrt(variance + eps)``)."""
    for add in item.users:
        if not ((add.op == "call_function" and add.target in _ADDS)
                or (add.op == "call_method" and add.target in ("add", "__add__", "__radd__"))):
            continue
        if any((u.op == "call_function" and u.target in _RSQRTS) or (u.op == "call_method" and u.target == "rsqrt")
               for u in add.users):
            return True
    return False


def specialize_norm_epsilons(gm: torch.fx.GraphModule) -> None:
    """Have Dynamo trace the graph again with the epsilons of hand-written norms as constants.

    Under ``dynamic=True`` (or once a float changed between calls) Dynamo passes a Python float
    it reads, such as Hugging Face's ``RMSNorm.variance_epsilon``, as a graph input (a float64
    scalar tensor) instead of a constant. A norm's epsilon is then a tensor in the graph and no
    norm rule can take the norm (every RMSNorm of a Hugging Face model was left unfused, and
    ``explain()`` had no near miss to show). Those floats are marked for specialisation and
    Dynamo's analysis restarts (its own mechanism for floats a compiler needs as constants,
    ``TensorifyScalarRestartAnalysis``): Dynamo then guards on their values, so a changed
    epsilon recompiles instead of running with a stale one. Other floats stay inputs. Once per
    float (a float that stays an input after the restart is left as it is)."""
    try:
        from torch._dynamo.exc import TensorifyScalarRestartAnalysis
        from torch._dynamo.symbolic_convert import TensorifyState
        from torch._guards import TracingContext
    except ImportError:  # another torch version: the norms stay unfused, nothing else changes
        return
    if TracingContext.try_get() is None:
        return  # not called by Dynamo (a graph handed over directly): nothing could restart
    names = []
    for node in gm.graph.nodes:
        if node.op != "placeholder" or not node.users or not all(_is_item(u) for u in node.users):
            continue
        memo = getattr(node.meta.get("example_value"), "item_memo", None)
        symbol = getattr(getattr(memo, "node", None), "_expr", None)
        name = getattr(symbol, "name", None)
        if not isinstance(name, str) or TensorifyState.should_specialize(name):
            continue
        if any(_is_norm_epsilon(item) for item in node.users):
            names.append(name)
    if names:
        for name in names:
            TensorifyState.specialize(name)
        raise TensorifyScalarRestartAnalysis
