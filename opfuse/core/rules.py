"""The process-wide rule registry: the built-in rules (each family's ``rules.py``, in the order of
the one list of families, :data:`opfuse.families.FAMILIES`) plus the rules users register.

Users add fusions without editing opfuse::

    from opfuse.passes import OpSpec, Pattern, Replacement, register_rule

    @register_rule(name="bias_gelu", pattern=Pattern.chain(OpSpec("bias", "Bias"), OpSpec("act", "GELU")))
    def build_bias_gelu(match):
        return Replacement(MyBiasGelu(match["bias"].op.bias), args=[match.input("bias")])

Rules are applied highest priority first; :func:`disabled_rules` switches rules off in a scope,
``OPFUSE_DISABLE_RULES`` does so globally.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..families import FAMILIES
from ..machinery import graph_pass as pass_registry
from ..machinery.pattern import Pattern, PatternError
from ..machinery.rule import Match, Replacement, Rule, RuleRegistry, caller_location

__all__ = ["BUILTIN_RULES", "get_registry", "register_rule", "remove_rule", "disabled_rules", "rules", "generation",
           "active_key", "is_builtin"]

#: The built-in rules: every family's, in the order of :data:`opfuse.families.FAMILIES`.
BUILTIN_RULES: tuple[Rule, ...] = tuple(rule for family in FAMILIES for rule in family.rules)

_REGISTRY = RuleRegistry(BUILTIN_RULES)


def get_registry() -> RuleRegistry:
    """The process-wide rule registry."""
    return _REGISTRY


def generation() -> int:
    """Changes whenever the active rules or the pass pipeline may have changed (compile caches key
    on it): both counters only grow, so their sum changes with either."""
    return _REGISTRY.generation + pass_registry.generation()


def is_builtin(name: str) -> bool:
    """Whether the rule registered as ``name`` is one of opfuse's built-in rules."""
    rule = _REGISTRY.get(name) if name in _REGISTRY.names() else None
    return rule is not None and any(rule is builtin for builtin in BUILTIN_RULES)


def active_key() -> tuple:
    """Identifies the set of rules that fire (compile caches key on it)."""
    return _REGISTRY.key()


def register_rule(rule: Rule | None = None, *, name: str | None = None, pattern: Pattern | None = None,
                  build: Callable[[Match], Replacement] | None = None, priority: int = 0,
                  where: Sequence[Any] = (), description: str = "", replace: bool = False):
    """Register a fusion rule (a :class:`Rule`, or its fields as keywords).

    Without ``build`` it returns a decorator for the builder function. Returns the registered
    :class:`Rule`. ``where`` is a sequence of predicates (``where=[fn]``); ``replace=True``
    replaces a rule of the same name.
    """
    if not isinstance(replace, bool):
        # bool("yes") is True: a misspelt flag silently replaced a rule.
        raise PatternError(f"register_rule: replace={replace!r}; expected True or False")
    if rule is not None:
        if any(v is not None for v in (name, pattern, build)):
            raise PatternError("register_rule: pass either a Rule or its fields, not both")
        return _REGISTRY.add(rule, replace=replace)
    if name is None or pattern is None:
        raise PatternError("register_rule: name= and pattern= are required")
    source = caller_location(1)

    def finish(builder: Callable[[Match], Replacement]) -> Rule:
        made = Rule(name=name, pattern=pattern, build=builder, priority=priority, where=where,
                    description=description or (builder.__doc__ or "").strip().split("\n")[0],
                    source=source)
        return _REGISTRY.add(made, replace=replace)

    if build is None:
        return finish
    return finish(build)


def _check_names(names, who: str) -> None:
    for name in names:
        if not isinstance(name, str):
            several = isinstance(name, (list, tuple, set, frozenset)) and who == "disabled_rules"
            hint = "; pass names as separate arguments (disabled_rules(*names))" if several else ""
            raise PatternError(f"{who}: {name!r} is not a rule name (a str){hint}")


def remove_rule(name: str) -> Rule:
    """Unregister the rule called ``name`` and return it."""
    _check_names([name], "remove_rule")
    return _REGISTRY.remove(name)


def disabled_rules(*names: str):
    """Context manager: rules ``names`` do not fire inside the block."""
    _check_names(names, "disabled_rules")
    return _REGISTRY.disabled(*names)


def rules() -> list[Rule]:
    """All registered rules, in the order they are tried."""
    return _REGISTRY.all()
