"""Families defined outside opfuse: :func:`register_family` adds one at run time.

opfuse's own families are listed in ``opfuse/families/__init__.py`` (``FAMILIES``), which is how a
fused op joins opfuse: a new folder plus one line there. A package of your own builds its
:class:`~opfuse.machinery.family.Family` the same way and registers it here instead: its fused ops
join the dispatch table, its rules the rule registry, its recognizers the torch.compile front end's.
"""

from __future__ import annotations

from .core import dispatch
from .core.rules import register_rule, remove_rule
from .machinery.family import Family
from .torch_compile.recognition import get_recognizer_registry

__all__ = ["register_family", "remove_family"]

_ADDED: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add ``family`` (its implementation table, rules and recognizers); blocks compile again on
    their next call. Errors name what clashes: a fused op, rule or recognizer name already taken.

    Examples
    --------
    >>> opfuse.register_family(FAMILY)      # doctest: +SKIP
    """
    if not isinstance(family, Family):
        raise TypeError(f"register_family: expected an opfuse.machinery.family.Family, got {type(family).__name__}")
    if family.name in _ADDED:
        raise ValueError(f"register_family: a family named {family.name!r} is registered; remove_family it first")
    dispatch.add_table(family.implementations)
    added_rules, added_recognizers = [], []
    try:
        for rule in family.rules:
            added_rules.append(register_rule(rule))
        for recognizer in family.recognizers:
            added_recognizers.append(get_recognizer_registry().add(recognizer))
    except Exception:
        for rule in added_rules:
            remove_rule(rule.name)
        for recognizer in added_recognizers:
            get_recognizer_registry().remove(recognizer.name)
        dispatch.remove_table(family.implementations)
        raise
    _ADDED[family.name] = family
    return family


def remove_family(name: str) -> Family:
    """Take a family added with :func:`register_family` out again."""
    try:
        family = _ADDED.pop(name)
    except KeyError:
        raise KeyError(f"remove_family: no family {name!r} was registered; registered: {sorted(_ADDED)}") from None
    for rule in family.rules:
        remove_rule(rule.name)
    for recognizer in family.recognizers:
        get_recognizer_registry().remove(recognizer.name)
    dispatch.remove_table(family.implementations)
    return family
