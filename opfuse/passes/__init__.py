"""The pass pipeline and the rule machinery.

Public API for users adding fusions:

* rules (patterns as data): :class:`OpSpec`, :class:`Pattern`, :class:`Rule`,
  :class:`Replacement`, :func:`predicate`, :func:`register_rule`, :func:`remove_rule`,
  :func:`disabled_rules`, :func:`rules` (and the reusable predicates in :mod:`.predicates`);
* graph passes (anything a rule cannot express): :func:`register_pass`, :func:`remove_pass`,
  :func:`passes`, :func:`disabled_passes`, :class:`PassContext` (what a pass receives),
  :class:`PassError`.
"""

from ..ops.base import PartitionError
from ..ops.sharding import plan_gemm
from ..machinery.context import FusionRecord, PassContext
from ..machinery.pattern import OpSpec, Pattern, PatternError, Predicate, predicate
from ..core.pipeline import BUILTIN_PASSES, Pass, PassError, disabled_passes, passes, register_pass, remove_pass
from ..core.rules import disabled_rules, register_rule, remove_rule, rules
from ..machinery.rule import Match, MatchedOp, Replacement, Rule, RuleError
from ..core.passes.verify import VerifyError

__all__ = [
    "BUILTIN_PASSES",
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
    "register_pass",
    "register_rule",
    "remove_pass",
    "remove_rule",
    "rules",
]
