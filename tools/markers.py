"""The generated parts of the docs: text between a begin and an end marker line, rewritten in place
by the tool that generates it (tools/layers.py, tools/reference_tables.py)."""

from __future__ import annotations

__all__ = ["replace_between"]


def replace_between(path: str, begin: str, end: str, text: str) -> bool:
    """Replace everything from ``begin`` to ``end`` (both included) in file ``path`` by ``text``
    (which should start with ``begin`` and end with ``end``); returns whether the file changed."""
    with open(path) as handle:
        old = handle.read()
    start, stop = old.index(begin), old.index(end) + len(end)
    new = old[:start] + text + old[stop:]
    if new != old:
        with open(path, "w") as handle:
            handle.write(new)
    return new != old
