"""The public API for rules and passes (``opfuse.passes``); the code lives in :mod:`opfuse.machinery`
(rules, patterns, predicates, pass contexts) and :mod:`opfuse.core` (the registries, the pipeline).

Public API for users adding fusions:

* rules (patterns as data): :class:`OpSpec`, :class:`Pattern`, :class:`Rule`,
  :class:`Replacement`, :func:`predicate`, :func:`register_rule`, :func:`remove_rule`,
  :func:`disabled_rules`, :func:`rules` (and the reusable predicates in :mod:`.predicates`);
* implementations of existing fused ops: :func:`register_implementation`, :class:`Implementation`,
  :class:`CallSpec`;
* graph passes (anything a rule cannot express): :func:`register_pass`, :func:`remove_pass`,
  :func:`passes`, :func:`disabled_passes`, :class:`PassContext` (what a pass receives),
  :class:`PassError`.
"""

from ..core.dispatch import register_implementation, remove_implementation
from ..core.passes.verify import VerifyError
from ..core.pipeline import BUILTIN_PASSES, Pass, PassError, disabled_passes, passes, register_pass, remove_pass
from ..core.rules import disabled_rules, register_rule, remove_rule, rules
from ..machinery.context import FusionRecord, PassContext
from ..machinery.implementation import CallSpec, Implementation
from ..machinery.pattern import OpSpec, Pattern, PatternError, Predicate, predicate
from ..machinery.rule import Match, MatchedOp, Replacement, Rule, RuleError
from ..ops.base import PartitionError
from ..ops.sharding import plan_gemm
from . import predicates

__all__ = [
    "BUILTIN_PASSES",
    "CallSpec",
    "Implementation",
    "FusionRecord",
    "Match",
    "MatchedOp",
    "OpSpec",
    "PartitionError",
    "Pass",
    "PassContext",
    "PassError",
    "Pattern",
    "PatternError",
    "Predicate",
    "Replacement",
    "Rule",
    "RuleError",
    "VerifyError",
    "disabled_passes",
    "disabled_rules",
    "passes",
    "plan_gemm",
    "predicate",
    "predicates",
    "register_implementation",
    "register_pass",
    "register_rule",
    "remove_implementation",
    "remove_pass",
    "remove_rule",
    "rules",
]
