"""Every rank of a process group must rewrite its graphs' collectives under the same opfuse settings:
checked at compile time, once per group and per change of this rank's settings.

opfuse rewrites the collectives of a graph as its settings say: ``OPFUSE_ALLREDUCE_CHUNKS`` splits
an all-reduce into chunks, a disabled rule leaves it unfused, ``OPFUSE_FORCE_IMPL`` picks the
implementation that runs it, a rule or recognizer registered on one rank fuses it there only.
Ranks that compile under different settings issue different collectives: NCCL hangs, gloo aborts
with "collective mismatch". So when the backend fuses a graph that calls collectives
(:func:`check_ranks_agree`, from :func:`~.graph_pass.fuse_graph` before it changes anything), each
rank computes its settings signature (:func:`signature_lines`) and, the first time it compiles a
collective graph on a group and again whenever its signature for that group changed since the
last check, compares it with the other members' through the default store
(:class:`opfuse.core.agree.Agreement`, keys ``opfuse/agree-compile/{group}/{n}``). A difference
raises :class:`~opfuse.core.agree.RankMismatchError` on every rank (Dynamo reports it as the
``BackendCompilerFailed`` of its backend), naming the first differing line, before any collective
of the graph runs.

The check is of settings, not of graphs: Dynamo may legitimately compile a graph on one rank only
(expert-parallel MoE layers with rank-dependent token counts recompile for new shapes), so a key
per compiled graph would drift between ranks. It follows that ranks whose settings differ from
the start (an ``OPFUSE_*`` variable exported on one rank: the common case) fail at their first
compile on the group, while a rank that changes its settings alone during a run checks again but
its peers, whose signature did not change, do not: it waits for them and fails after
``opfuse.config.peer_timeout_ms``. Single processes, groups of one rank and graphs without
collectives exchange nothing.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import fx

from ..core import agree as core
from ..ops import group as groups
from .fp8 import CompileSettings
from .overlap import is_collective
from .recognition import get_recognizer_registry

__all__ = ["COMPILE_SETTINGS", "collective_groups", "signature_lines", "check_ranks_agree", "CompileAgreement"]

#: Settings that only this front end reads and that change how it rewrites a graph's collectives
#: (besides :data:`opfuse.core.agree.SHARED_SETTINGS`).
COMPILE_SETTINGS = ("overlap_collectives", "allreduce_chunks", "overlap_sm_carveout", "reference_fusions")

# Group name -> digest of the signature this rank last agreed on with the group's other members.
_agreed: dict[str, str] = {}


class CompileAgreement(core.Agreement):
    """One settings check of the torch.compile backend over some process groups."""

    prefix = "opfuse/agree-compile"
    subject = "settings check #{number} of the torch.compile backend on it"
    absent = "did not compile a graph with collectives on this group under new settings"
    absent_hint = ("a rank whose opfuse settings changed checks them again at its next compile on the group, its "
                   "peers only when theirs change too: change settings on every rank, or on none")
    differ = "the ranks compile with different opfuse settings"
    differ_hint = ("every rank must compile under the same opfuse settings (OPFUSE_* variables, opfuse.config), "
                   "rules, passes, implementations, recognizers and backend options (fp8=, fp8_filter=, "
                   "options['inductor']): with others, the ranks rewrite their collectives differently and hang")


def _group_name(node: fx.Node) -> str | None:
    """The ``group_name`` argument of a functional collective (``None`` for ``wait_tensor``)."""
    if "group_name" in node.kwargs:
        return node.kwargs["group_name"]
    schema = getattr(node.target, "_schema", None)
    for index, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.name == "group_name":
            return node.args[index] if index < len(node.args) else None
    return None


def collective_groups(gm: fx.GraphModule) -> list:
    """The process groups (world size > 1) that the collectives of ``gm`` (and of its subgraphs)
    use, by name; empty without an initialised default group."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    names = set()
    for module in gm.modules():
        graph = getattr(module, "graph", None)
        for node in graph.nodes if isinstance(graph, fx.Graph) else ():
            name = _group_name(node) if is_collective(node) else None
            if isinstance(name, str):
                names.add(name)
    found = []
    for name in sorted(names):
        try:
            pg = groups.from_name(name)
        except Exception:  # noqa: BLE001 - a group this process does not know; the recognizers leave it alone too
            continue
        if dist.get_world_size(pg) > 1:
            found.append(pg)
    return found


def signature_lines(settings: CompileSettings) -> list[str]:
    """This rank's compile settings signature: the settings, rules, passes and implementations
    (:func:`opfuse.core.agree.settings_lines`), the active recognizers, and the backend options
    that change the rewrite."""
    lines = core.settings_lines(COMPILE_SETTINGS)
    lines.append(f"recognizers {[r.name for r in get_recognizer_registry().active()]}")
    fp8 = settings.fp8.key() if settings.fp8 is not None else None
    lines.append(f"backend fp8={fp8} fp8_filter={'given' if settings.fp8_filter is not None else None} "
                 f"inductor={settings.inductor}")
    return lines


def check_ranks_agree(gm: fx.GraphModule, settings: CompileSettings) -> None:
    """Check that the other members of each group ``gm``'s collectives use compile under this
    rank's settings, where this rank has not checked that signature on the group yet (see the
    module docstring); raises :class:`~opfuse.core.agree.RankMismatchError` if not."""
    pgs = collective_groups(gm)
    if not pgs:
        return
    try:
        lines, error = signature_lines(settings), None
    except Exception as failure:  # noqa: BLE001 - e.g. a misspelt rule name: published, then raised
        lines, error = None, failure
    signature = core.digest(lines) if lines is not None else None
    due = [pg for pg in pgs if signature is None or _agreed.get(pg.group_name) != signature]
    if not due:
        return
    agreement = CompileAgreement(due)
    agreement.publish(lines, error=error)  # the others fail at once instead of waiting for this rank
    if error is not None:
        raise error
    agreement.verify()
    for pg in due:
        _agreed[pg.group_name] = signature
