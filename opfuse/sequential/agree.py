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
timeout.

The signature lists every value of the partitioned graph: the op that computes it, its dtype,
device type and layout, and its full shape where a collective reads or writes it (ranks may hold
different numbers of tokens where only local ops see them, e.g. expert-parallel rows).
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import json

import torch.distributed as dist
from torch import fx

from ..config import config
from ..ops import group as groups
from ..core.pipeline import get_pass_registry
from ..core.rules import active_key
from . import replicated

__all__ = ["RankMismatchError", "groups_of", "signature_lines", "Agreement"]

#: Settings that change what a compile produces (paths, dumps and timeouts do not).
_COMPILE_SETTINGS = ("fuse", "disabled_rules", "disabled_passes", "force_impl", "cuda", "symm_pool_mb", "symm_pool_max_mb",
                     "oneshot_max_bytes", "twoshot_max_bytes", "overlap_chunks", "overlap_alternate_streams",
                     "check_replicated")
_compiles: collections.Counter = collections.Counter()


class RankMismatchError(RuntimeError):
    """The ranks of a process group compiled different programs, or did not all compile."""


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
    """The program signature the ranks compare (see the module docstring)."""
    collective = set()
    for node in gm.graph.nodes:
        if node.op == "call_module" and getattr(gm.get_submodule(node.target), "is_collective", False):
            collective.add(node)
            collective.update(a for a in node.all_input_nodes)
    lines = [f"settings {[(name, getattr(config, name)) for name in _COMPILE_SETTINGS]}",
             f"rules {[name for name, _, _ in active_key()]}",
             f"passes {[item.name for item in get_pass_registry().active()]}"]
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


def _timeout() -> datetime.timedelta:
    ms = config.peer_timeout_ms
    return datetime.timedelta(milliseconds=ms) if ms else datetime.timedelta(days=365)


class Agreement:
    """One compile's check over ``pgs``: :meth:`publish` (the signature or an error), then
    :meth:`verify`. Each group counts its compiles, so keys never collide between programs."""

    def __init__(self, pgs: list):
        self.pgs = pgs
        self.checked: list = []  # the inputs whose digests are compared (.replicated)
        self.keys = {}
        for pg in pgs:
            _compiles[pg.group_name] += 1
            self.keys[pg.group_name] = f"opfuse/agree/{pg.group_name}/{_compiles[pg.group_name]}"

    def _store(self):
        return dist.distributed_c10d._get_default_store()

    def publish(self, lines: list[str] | None = None, error: BaseException | None = None, checked=(),
                values: dict | None = None) -> None:
        """Publish this rank's signature ``lines`` (and the digests ``values`` of the ``checked``
        replicated inputs, :mod:`.replicated`), or the ``error`` its compile raised."""
        if not self.pgs:
            return
        if error is not None:
            payload = {"error": f"{type(error).__name__}: {error}"}
        else:
            self.checked = list(checked)
            payload = {"digest": hashlib.sha256("\n".join(lines).encode()).hexdigest(), "lines": lines,
                       "values": values}
        text = json.dumps(payload)
        store = self._store()
        for pg in self.pgs:
            store.set(f"{self.keys[pg.group_name]}/{dist.get_rank(pg)}", text)

    def verify(self) -> None:
        """Wait for every member's signature and compare; raise :class:`RankMismatchError` on a
        difference, an error elsewhere, or a member that does not arrive in time."""
        if not self.pgs:
            return
        store = self._store()
        for pg in self.pgs:
            self._verify_group(store, pg)

    def _verify_group(self, store, pg) -> None:
        prefix, world, me = self.keys[pg.group_name], dist.get_world_size(pg), dist.get_rank(pg)
        members = dist.get_process_group_ranks(pg)
        keys = [f"{prefix}/{r}" for r in range(world)]
        where = (f"process group {pg.group_name!r} (global ranks {members}), compile #{prefix.rsplit('/', 1)[-1]} "
                 f"of a program on it")
        try:
            store.wait(keys, _timeout())
        except Exception as error:  # noqa: BLE001 - the store's timeout error; named below
            missing = [members[r] for r in range(world) if not store.check([keys[r]])]
            raise RankMismatchError(
                f"opfuse: {where}: global rank(s) {missing} did not compile this program within "
                f"{config.peer_timeout_ms} ms (OPFUSE_PEER_TIMEOUT_MS); every rank of a group must call its blocks "
                f"with the same input signatures, settings and rules, in the same order ({error})") from None
        payloads = [json.loads(store.get(key)) for key in keys]
        failed = [(members[r], p["error"]) for r, p in enumerate(payloads) if "error" in p]
        if failed:
            listed = "; ".join(f"global rank {rank}: {text}" for rank, text in failed)
            raise RankMismatchError(f"opfuse: {where}: compiling failed on {listed}")
        mine = payloads[me]
        others = [r for r, p in enumerate(payloads) if p["digest"] != mine["digest"]]
        if not others:
            replicated.compare(where, self.checked, [p.get("values") for p in payloads], members, me, every_call=False)
            return
        # Every rank raises; each names the first line where a differing rank's program departs.
        other = payloads[others[0]]
        first = next((i for i, (a, b) in enumerate(zip(mine["lines"], other["lines"])) if a != b),
                     min(len(mine["lines"]), len(other["lines"])))
        line = lambda p: p["lines"][first] if first < len(p["lines"]) else "(end of program)"  # noqa: E731
        raise RankMismatchError(
            f"opfuse: {where}: the ranks compiled different programs (global ranks "
            f"{[members[r] for r in others]} differ from global rank {members[me]}); first difference:\n"
            f"  global rank {members[me]}: {line(mine)}\n"
            f"  global rank {members[others[0]]}: {line(other)}\n"
            f"every rank must build the same block (parallel modes, sizes, dtypes) and call it with inputs of the "
            f"same shapes (sequence-parallel shards of equal size) under the same settings")
