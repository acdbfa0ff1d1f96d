"""Pass pipeline, rule machinery, built-in and partition rules.

Public API for users adding fusions: :class:`OpSpec`, :class:`Pattern`, :class:`Rule`,
:class:`Replacement`, :func:`predicate`, :func:`register_rule`, :func:`remove_rule`,
:func:`disabled_rules`, :func:`rules`.
"""

from .partition import PartitionError, plan_gemm
from .pattern import OpSpec, Pattern, PatternError, Predicate, predicate
from .pipeline import PIPELINE
from .rule import Match, MatchedOp, Replacement, Rule, disabled_rules, register_rule, remove_rule, rules

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
