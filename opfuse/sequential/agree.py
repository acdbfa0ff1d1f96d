"""The ranks of every process group a program uses must compile the same program: checked once per
compile, never per call.

Ranks that disagree (different ``parallel=`` modes, shapes or dtypes, uneven sequence-parallel
token counts, different settings) would otherwise issue mismatched collectives: gloo aborts with
"collective mismatch", NCCL hangs. After the partition pass (pure: no communication yet), each
rank publishes a digest of its program's signature to the default store under a key per group
and per compile of that group, waits for the other members' digests (at most
``opfuse.config.peer_timeout_ms``), and compares. A difference raises :class:`RankMismatchError`
on every rank, naming the ranks and the first line of the signatures that differs; a rank that
fails to compile publishes its error so the others fail at once instead of waiting; a rank that
never arrives (it did not compile: its cache held a program the others lack) is named after the
timeout. The store protocol is :mod:`opfuse.core.agree`'s, shared with the torch.compile
backend's check (:mod:`opfuse.torch_compile.agree`).

The signature starts with the settings, rules, passes and implementations
(:func:`opfuse.core.agree.settings_lines`), then lists every value of the partitioned graph: the
op that computes it, its dtype, device type and layout, and its full shape where a collective
reads or writes it (ranks may hold different numbers of tokens where only local ops see them,
e.g. expert-parallel rows).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import fx

from ..core import agree as core
from ..core.agree import RankMismatchError
from ..ops import group as groups
from . import replicated

__all__ = ["RankMismatchError", "groups_of", "signature_lines", "Agreement"]

#: Settings that change what a block's compile produces besides the ones both front ends read
#: (:data:`opfuse.core.agree.SHARED_SETTINGS`).
_COMPILE_SETTINGS = ("check_replicated",)


def groups_of(seq) -> list:
    """The process groups (world size > 1) the ops of ``seq`` communicate over, by name."""
    found = {}
    for index, op in enumerate(seq):
        for group in op.process_groups():
            pg = groups.resolve(group, f"Sequential op {index}: {op.kind}")
            if dist.get_world_size(pg) > 1:
                found.setdefault(pg.group_name, pg)
    return [found[name] for name in sorted(found)]


def _meta(meta, full: bool) -> str:
    if meta is None:
        return "?"
    if isinstance(meta, tuple):
        return "(" + ", ".join(_meta(m, full) for m in meta) + ")"
    dims = ", ".join(map(str, meta.shape if full else ("*",) * (len(meta.shape) - 1) + meta.shape[-1:]))
    grad = " requires_grad" if meta.requires_grad else ""
    return f"{str(meta.dtype).replace('torch.', '')}[{dims}]@{meta.device.type}{grad}"


def signature_lines(gm: fx.GraphModule) -> list[str]:
    """The program signature the ranks compare (see the module docstring): the settings, rules,
    passes and implementations (:func:`opfuse.core.agree.settings_lines`), then every value."""
    collective = set()
    for node in gm.graph.nodes:
        if node.op == "call_module" and getattr(gm.get_submodule(node.target), "is_collective", False):
            collective.add(node)
            collective.update(a for a in node.all_input_nodes)
    lines = core.settings_lines(_COMPILE_SETTINGS)
    for node in gm.graph.nodes:
        sharding = node.meta.get("opfuse_sharding")
        layout = sharding.describe() if sharding is not None else "-"
        value = _meta(node.meta.get("opfuse_meta"), node in collective)
        if node.op == "call_module":
            what = gm.get_submodule(node.target).describe()
        elif node.op == "output":
            what = "output " + ", ".join(a.name for a in node.all_input_nodes)
        else:
            what = node.op
        lines.append(f"{node.name}: {what} -> {value} {layout}")
    return lines


class Agreement(core.Agreement):
    """One compile's check over ``pgs``: :meth:`publish` (the signature or an error), then
    :meth:`verify` (:class:`opfuse.core.agree.Agreement`, which counts each group's compiles, so
    keys never collide between programs); the ranks' replicated inputs are compared too."""

    prefix = "opfuse/agree"
    subject = "compile #{number} of a program on it"
    absent = "did not compile this program"
    absent_hint = ("every rank of a group must call its blocks with the same input signatures, settings and rules, "
                   "in the same order")
    differ = "the ranks compiled different programs"
    differ_hint = ("every rank must build the same block (parallel modes, sizes, dtypes) and call it with inputs of "
                   "the same shapes (sequence-parallel shards of equal size) under the same settings")

    def __init__(self, pgs: list):
        super().__init__(pgs)
        self.checked: list = []  # the inputs whose digests are compared (.replicated)

    def publish(self, lines: list[str] | None = None, error: BaseException | None = None, checked=(),
                values: dict | None = None) -> None:
        """Publish this rank's signature ``lines`` (and the digests ``values`` of the ``checked``
        replicated inputs, :mod:`.replicated`), or the ``error`` its compile raised."""
        if error is None:
            self.checked = list(checked)
        super().publish(lines, error, extra={"values": values})

    def agreed(self, where: str, payloads: list[dict], members: list[int], me: int) -> None:
        replicated.compare(where, self.checked, [p.get("values") for p in payloads], members, me, every_call=False)
