"""Verify: the graph is well formed and executable.

:func:`check_invariants` runs after every registered pass (and names it): the graph lints (no
value used before it is defined, no reference to an erased node or a missing module), every value
carries metadata, and every basic op's recorded shape, dtype and layout agree with what the op
computes from its inputs. The final :func:`verify` pass adds what only holds at the end:
composites expanded, an implementation chosen for every fused op, and every node that a user
rule fused computing the shapes, dtypes and devices of the ops it replaced (a
:class:`~opfuse.machinery.rule.RuleError` naming the rule).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ...machinery.fused_op import FusedOp
from ...config import config
from ...ops.base import BasicOp, OpInputError, TensorMeta
from ..rules import is_builtin
from ...machinery.rule import RuleError

__all__ = ["verify", "check_invariants", "VerifyError"]


class VerifyError(RuntimeError):
    """A pass produced a malformed graph (a bug in a rule or pass)."""


def _same(a: TensorMeta, b: TensorMeta) -> bool:
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


def _check_basic_op(node: fx.Node, op: BasicOp, where: str) -> None:
    args = [a for a in node.args if isinstance(a, fx.Node)]
    metas = [a.meta.get("opfuse_meta") for a in args]
    if any(not isinstance(m, TensorMeta) for m in metas):
        return  # an input without single-tensor metadata is reported at that input
    try:
        inferred = op.infer_meta(*metas)
    except OpInputError as error:
        raise VerifyError(f"{where}: {node.name} ({op.kind}) has invalid inputs: {error}") from None
    recorded = node.meta["opfuse_meta"]
    if isinstance(recorded, TensorMeta) and not _same(inferred, recorded):
        raise VerifyError(f"{where}: {node.name} ({op.kind}) is recorded as {recorded} but computes {inferred} from "
                          f"its inputs ({', '.join(a.name for a in args)})")
    shardings = [a.meta.get("opfuse_sharding") for a in args]
    recorded_layout = node.meta.get("opfuse_sharding")
    if recorded_layout is None or any(s is None for s in shardings):
        return
    try:
        layout = op.propagate_sharding(*shardings)
    except OpInputError as error:
        raise VerifyError(f"{where}: {node.name} ({op.kind}) gets inputs laid out in a way it cannot take: "
                          f"{error}") from None
    # Feature sharding and partial sums are what turn into wrong numbers; token layouts of
    # expanded composites are set by their expansion (expert-parallel outputs), not by one op.
    if (layout.features, layout.partial) != (recorded_layout.features, recorded_layout.partial):
        raise VerifyError(f"{where}: {node.name} ({op.kind}) is recorded as {recorded_layout.describe()} but its "
                          f"inputs make it {layout.describe()}")


def check_invariants(gm: fx.GraphModule, ctx, where: str) -> None:
    """Raise :class:`VerifyError` (prefixed with ``where``) unless the graph lints and every value's
    metadata and layout are consistent with its op and inputs."""
    try:
        gm.graph.lint()
    except Exception as error:  # fx raises RuntimeError with details
        raise VerifyError(f"{where}: graph lint failed: {error}") from error
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if "opfuse_meta" not in node.meta:
            raise VerifyError(f"{where}: {node.name} has no tensor metadata; annotate new nodes with "
                              f"ctx.annotate(node, meta, sharding)")
        if node.op == "call_function" and node.target is operator.getitem:
            source, index = node.args
            whole = source.meta.get("opfuse_meta")
            if isinstance(whole, tuple) and isinstance(index, int):
                if index >= len(whole) or not _same(whole[index], node.meta["opfuse_meta"]):
                    raise VerifyError(f"{where}: {node.name} = {source.name}[{index}] is recorded as "
                                      f"{node.meta['opfuse_meta']} but {source.name} yields {whole}")
            continue
        if node.op != "call_module":
            continue
        op = gm.get_submodule(node.target)
        if isinstance(op, BasicOp) and not getattr(op, "is_composite", False):
            _check_basic_op(node, op, where)


def _fused_outputs(node: fx.Node) -> dict[int | None, TensorMeta]:
    """What the matched ops computed, by output index of the fused node (``None``: the node's
    value itself)."""
    found = {}
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
            found[user.args[1]] = user.meta.get("opfuse_meta")
    if not found and isinstance(node.meta.get("opfuse_meta"), TensorMeta):
        found[None] = node.meta["opfuse_meta"]
    return found


def _computed(module, node: fx.Node):
    """The replacement's outputs for the node's input metadata: ``infer_meta`` of a basic op,
    else a run on fake tensors; ``None`` when that cannot be told (a module fake tensors cannot run)."""
    metas = [a.meta.get("opfuse_meta") if isinstance(a, fx.Node) else a for a in node.args]
    if isinstance(module, BasicOp):
        return module.infer_meta(*metas)
    from torch._subclasses.fake_tensor import FakeTensorMode  # its first use costs ~2 s: only for user rules

    try:
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
            args = [torch.empty(m.shape, dtype=m.dtype, device=m.device) if isinstance(m, TensorMeta) else m
                    for m in metas]
            return module(*args)
    except Exception:  # noqa: BLE001 - an opaque module: nothing to compare
        return None


def check_replacement(gm: fx.GraphModule, node: fx.Node) -> None:
    """Raise :class:`RuleError` naming the rule that fused ``node`` if its module computes another
    shape, dtype or device than the ops it replaced."""
    module = gm.get_submodule(node.target)
    computed = _computed(module, node)
    if computed is None:
        return
    rule = f"rule {node.meta['opfuse_rule']!r} ({node.meta.get('opfuse_source', '?')})"
    for index, want in _fused_outputs(node).items():
        if want is None:
            continue
        got = computed
        if isinstance(computed, (tuple, list)):
            got = computed[index or 0] if (index or 0) < len(computed) else None
        if got is None or not hasattr(got, "shape"):
            raise RuleError(f"{rule}: its replacement {type(module).__name__} has no output {index} for {node.name}")
        if (tuple(got.shape), got.dtype, torch.device(got.device)) != (tuple(want.shape), want.dtype,
                                                                      torch.device(want.device)):
            have = TensorMeta(tuple(got.shape), got.dtype, torch.device(got.device))
            which = "" if index is None else f" (output {index})"
            covered = ", ".join(name for name, _ in node.meta.get("opfuse_covered", ()))
            raise RuleError(f"{rule}: its replacement {type(module).__name__} computes {have}{which} where the ops it "
                            f"replaced computed {want} (fused node {node.name}, covering {covered})")


def verify(gm: fx.GraphModule, ctx) -> None:
    if not config.verify:
        return
    try:
        gm.graph.lint()
    except Exception as error:  # fx raises RuntimeError with details
        raise VerifyError(f"graph lint failed after the pipeline: {error}") from error
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        op = gm.get_submodule(node.target)
        if getattr(op, "is_composite", False):
            raise VerifyError(f"{node.name}: composite op {op.kind} was not expanded by the partition pass")
        if isinstance(op, FusedOp) and op.implementation is None:
            raise VerifyError(f"{node.name}: fused op {op.kind} has no implementation selected")
        if "opfuse_meta" not in node.meta:
            raise VerifyError(f"{node.name}: no tensor metadata (a rule dropped node.meta)")
        if "opfuse_rule" in node.meta and not is_builtin(node.meta["opfuse_rule"]):
            # Built-in replacements are checked against the unfused math by the test suite.
            check_replacement(gm, node)
