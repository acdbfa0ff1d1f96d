"""The pass pipeline and the rule machinery.

Public API for users adding fusions: :class:`OpSpec`, :class:`Pattern`, :class:`Rule`,
:class:`Replacement`, :func:`predicate`, :func:`register_rule`, :func:`remove_rule`,
:func:`disabled_rules`, :func:`rules` (and the reusable predicates in :mod:`.predicates`).
"""

from ..ops.base import PartitionError
from ..ops.sharding import plan_gemm
from .pattern import OpSpec, Pattern, PatternError, Predicate, predicate
from .pipeline import PIPELINE
from .registry import disabled_rules, register_rule, remove_rule, rules
from .rule import Match, MatchedOp, Replacement, Rule

__all__ = [
    "Match",
    "MatchedOp",
    "OpSpec",
    "PIPELINE",
    "PartitionError",
    "Pattern",
    "PatternError",
    "Predicate",
    "Replacement",
    "Rule",
    "disabled_rules",
    "plan_gemm",
    "predicate",
    "register_rule",
    "remove_rule",
    "rules",
]
