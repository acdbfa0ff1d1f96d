"""``Program.explain()``: which rules fired, which almost did, and why not.

Near misses are computed on the program's graph *before* fusion (after partitioning), where every
basic op is still visible: for each rule and each place it starts to match, the longest prefix of
its pattern that matched and the first thing that failed (a missing or different op, a predicate,
a legality check). Full matches that did not fire because a higher-priority rule took some of the
same ops are reported as shadowed.
"""

from __future__ import annotations

import dataclasses

from ..config import config
from ..machinery.matcher import NearMiss, near_misses
from .rules import get_registry

__all__ = ["Explanation", "explain_program", "format_explanation"]


@dataclasses.dataclass
class Explanation:
    fusions: list
    near_misses: list[NearMiss]
    #: ``(pass name, remark)`` from the passes (e.g. why the horizontal pass left GEMMs apart).
    notes: list = dataclasses.field(default_factory=list)


def explain_program(program, verbose: bool = False) -> Explanation:
    registry = get_registry()
    before = program.unfused_graph_module
    covered_by = {}
    for record in program.fusions:
        for name in record.nodes:
            covered_by[name] = record
    misses = []
    for rule in registry.all():
        disabled = registry.is_disabled(rule)
        if disabled is None and not config.fuse:
            disabled = "fusion is off (OPFUSE_FUSE=0 / config.fuse=False)"
        for miss in near_misses(before, rule, disabled_reason=disabled):
            names = [item.split(" ")[0] for item in miss.matched]
            records = {covered_by[n].fused_node: covered_by[n] for n in names if n in covered_by}
            if any(r.rule == rule.name for r in records.values()):
                continue  # the rule fired here
            if len(miss.matched) == miss.total and miss.reason.startswith("matches:"):
                if len(records) == 1 and len(records) == len({covered_by.get(n) and covered_by[n].fused_node
                                                              for n in names}) and not verbose:
                    continue  # a larger rule took exactly these ops: nothing to explain
                other = ", ".join(f"{r.rule} ({r.fused_node})" for r in records.values()) or "another rule"
                miss.reason = f"shadowed: these ops were fused by {other}, which ran first"
            elif len(miss.matched) < miss.total and not verbose:
                # Partial matches over ops that another rule fused, or of a single op, say little.
                if records or len(miss.matched) < 2:
                    continue
            misses.append(miss)
    misses.sort(key=lambda m: (-len(m.matched) / m.total, m.rule))
    return Explanation(list(program.fusions), misses, list(getattr(program, "notes", ())))


def format_explanation(program, explanation: Explanation) -> str:
    lines = [f"opfuse program: {program.describe_inputs()}"]
    lines.append("fusions:" if explanation.fusions else "fusions: none")
    for record in explanation.fusions:
        lines.append(f"  {record}")
        for name, reason in record.skipped:
            lines.append(f"      skipped impl {name}: {reason}")
    lines.append("near misses:" if explanation.near_misses else "near misses: none")
    for miss in explanation.near_misses:
        lines.append(f"  {miss.describe()}")
    if explanation.notes:
        lines.append("pass notes:")
        lines.extend(f"  {name}: {message}" for name, message in explanation.notes)
    return "\n".join(lines) + "\n"
