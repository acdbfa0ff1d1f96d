"""One process-wide counter that moves whenever something a compiled program depends on may have
changed: an op's attributes, parameters, dtype or device, a block's structure, a setting, or the
set of fusion rules.

A compiled block's per-call guard compares it (one integer) instead of re-deriving its cache
key; when it moved, the block recomputes the full key (:mod:`opfuse.sequential.cache`). Only writers
that cannot be told apart from harmless ones cheaply bump it; readers never do.
"""

__all__ = ["bump", "current"]

#: The counter (read it as ``epoch.value``; the guard does, without a function call).
value = 0


def bump() -> None:
    """Record a change that may invalidate compiled programs."""
    global value
    value += 1


def current() -> int:
    return value
