"""``Program.explain()``: which rules fired, which almost did, and why not.

Near misses are computed on the program's graph *before* fusion (after partitioning), where every
basic op is still visible: for each rule and each place it starts to match, the longest prefix of
its pattern that matched and the first thing that failed (a missing or different op, a predicate,
a legality check). Full matches that did not fire because a higher-priority rule took some of the
same ops are reported as shadowed.

Rules that need FP8 (a required ``Quantize``, or a GEMM that must be FP8) are left out of the
near misses of programs without FP8 (no ``fp8.autocast`` recipe put FP8 into the graph): they
would restate the plain rule's miss in terms that do not apply. So are partial matches that
stopped before an op of a kind the program has nowhere (``BasicLinear -> Bias``, expected GELU, in
a model without GELU): every biased projection of such a model would be listed.
"""

from __future__ import annotations

import dataclasses

from ..config import config
from ..machinery.matcher import NearMiss, near_misses, node_kind, node_op
from ..machinery.predicates import is_fp8
from .rules import get_registry

__all__ = ["Explanation", "explain_program", "format_explanation", "needs_fp8", "uses_fp8"]


def needs_fp8(rule) -> bool:
    """Whether ``rule`` can only match FP8 programs: a required op is a ``Quantize`` or must be
    an FP8 GEMM."""
    for spec in rule.pattern.specs:
        if spec.optional:
            continue
        if set(spec.kinds) <= {"Quantize"} or any(pred is is_fp8 for pred in spec.where):
            return True
    return False


def uses_fp8(gm) -> bool:
    """Whether graph ``gm`` has FP8 in it: a ``Quantize``, an FP8 GEMM, or an FP8 value."""
    for node in gm.graph.nodes:
        op = node_op(gm, node)
        if op is not None and (getattr(op, "kind", None) == "Quantize" or getattr(op, "recipe", None) is not None):
            return True
        meta = node.meta.get("opfuse_meta")
        if getattr(meta, "quantized", None) is not None:
            return True
    return False


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
    fp8 = verbose or uses_fp8(before)
    present = {node_kind(before, node) for node in before.graph.nodes}
    for rule in registry.all():
        if not fp8 and needs_fp8(rule):
            continue
        disabled = registry.is_disabled(rule)
        if disabled is None and not config.fuse:
            disabled = "fusion is off (OPFUSE_FUSE=0 / config.fuse=False)"
        for miss in near_misses(before, rule, disabled_reason=disabled):
            names = [item.split(" ")[0] for item in miss.matched]
            records = {covered_by[n].fused_node: covered_by[n] for n in names if n in covered_by}
            if any(r.rule == rule.name for r in records.values()):
                continue  # the rule fired here
            if (len(miss.matched) == miss.total and len(records) == 1 and all(n in covered_by for n in names)
                    and not miss.reason.startswith("matches:")):
                (other,) = records.values()  # e.g. all_gather_keep took a gather the backward reads too
                miss.reason = f"fused by {other.rule} ({other.fused_node}) instead; this rule could not: {miss.reason}"
            if len(miss.matched) == miss.total and miss.reason.startswith("matches:"):
                if len(records) == 1 and len(records) == len({covered_by.get(n) and covered_by[n].fused_node
                                                              for n in names}) and not verbose:
                    continue  # a larger rule took exactly these ops: nothing to explain
                other = ", ".join(f"{r.rule} ({r.fused_node})" for r in records.values()) or "another rule"
                miss.reason = f"shadowed: these ops were fused by {other}, which ran first"
            elif len(miss.matched) < miss.total and not verbose:
                # Partial matches over ops that another rule fused, or of a single op, say little;
                # except where a predicate stopped this rule and a smaller rule, tried after it, took
                # part of its ops (the all-reduce and the add fused, the norm refused): that is
                # why the larger fusion did not happen.
                if len(miss.matched) < 2:
                    continue
                if miss.expected is not None and not set(miss.expected[0]) & present:
                    continue  # it stopped before an op this program has nowhere: it cannot fire here
                if records and not ("predicate failed" in miss.reason
                                    and all(_priority(registry, r.rule) < rule.priority for r in records.values())):
                    continue
            misses.append(miss)
    misses.sort(key=lambda m: (-len(m.matched) / m.total, m.rule))
    return Explanation(list(program.fusions), misses, list(getattr(program, "notes", ())))


def _priority(registry, name: str) -> float:
    return registry.get(name).priority if name in registry.names() else float("inf")


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
