"""The ranks of a process group must agree before they communicate: the store protocol both front
ends' checks use (:mod:`opfuse.sequential.agree`: every compile of a block;
:mod:`opfuse.torch_compile.agree`: the settings the backend rewrites collectives under).

A check is identified by a key per process group and per check of that group, under a prefix of
the front end's own. Each rank publishes a digest of its signature (lines of text) to the default
c10d store, waits for the other members' (at most ``opfuse.config.peer_timeout_ms``; 0 waits a
year), and compares. A difference raises :class:`RankMismatchError` on every rank, naming the ranks
and the first line that differs; a rank that failed before it had a signature publishes its error
so the others fail at once instead of waiting; a rank that never arrives is named after the
timeout.

:func:`settings_lines` is the part of every signature that says what a compile depends on besides
its graph: the settings the core and the families read, the active rules, passes and
implementations. One line per setting, so that the first differing line names the setting.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import json

import torch.distributed as dist

from ..config import config, env_name
from . import dispatch
from .pipeline import get_pass_registry
from .rules import active_key

__all__ = ["RankMismatchError", "SHARED_SETTINGS", "settings_lines", "digest", "Agreement"]

#: Settings that the core pipeline, the rules and the families' implementation choice read, and so
#: change what either front end's compile produces (paths, dumps, logging and timeouts do not).
SHARED_SETTINGS = ("fuse", "disabled_rules", "disabled_passes", "force_impl", "cuda", "symm_pool_mb",
                   "symm_pool_max_mb", "oneshot_max_bytes", "twoshot_max_bytes", "overlap_chunks",
                   "overlap_alternate_streams")

# Checks made so far per (key prefix, group name): the number in the next check's key.
_checks: collections.Counter = collections.Counter()


class RankMismatchError(RuntimeError):
    """The ranks of a process group compiled different programs or under different settings, or
    did not all compile."""


def settings_lines(extra: tuple[str, ...] = ()) -> list[str]:
    """The header of a signature: one line per setting of :data:`SHARED_SETTINGS` and ``extra``
    (the front end's own), then the active rules, passes and implementations."""
    lines = [f"setting {name}={getattr(config, name)!r} ({env_name(name)})" for name in SHARED_SETTINGS + extra]
    lines.append(f"rules {[name for name, _, _ in active_key()]}")
    lines.append(f"passes {[item.name for item in get_pass_registry().active()]}")
    lines.append(f"implementations {dispatch.names()}")
    return lines


def digest(lines: list[str]) -> str:
    """The digest of a signature that the ranks compare."""
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _timeout() -> datetime.timedelta:
    ms = config.peer_timeout_ms
    return datetime.timedelta(milliseconds=ms) if ms else datetime.timedelta(days=365)


class Agreement:
    """One check over the process groups ``pgs``: :meth:`publish` (the signature or an error), then
    :meth:`verify`. Each group counts its checks under :attr:`prefix`, so keys never collide.

    Subclasses set the key prefix and the words of the messages; :meth:`agreed` is their hook for
    what to compare once the signatures match."""

    #: Store keys are ``{prefix}/{group name}/{number of the check on that group}/{group rank}``.
    prefix = "opfuse/agree"
    #: What one check is, for messages (``{number}``: its number on the group).
    subject = "check #{number} on it"
    #: What a rank that did not publish in time failed to do, and what every rank must do.
    absent = "did not reach this check"
    absent_hint = "every rank of a group must compile the same programs in the same order"
    #: What differed, and what every rank must keep the same.
    differ = "the ranks' signatures differ"
    differ_hint = "every rank must compile the same program under the same settings"

    def __init__(self, pgs: list):
        self.pgs = pgs
        self.keys = {}
        for pg in pgs:
            _checks[self.prefix, pg.group_name] += 1
            self.keys[pg.group_name] = f"{self.prefix}/{pg.group_name}/{_checks[self.prefix, pg.group_name]}"

    def _store(self):
        return dist.distributed_c10d._get_default_store()

    def publish(self, lines: list[str] | None = None, error: BaseException | None = None,
                extra: dict | None = None) -> None:
        """Publish this rank's signature ``lines`` (with ``extra`` entries for :meth:`agreed`), or
        the ``error`` that kept it from having one."""
        if not self.pgs:
            return
        if error is not None:
            payload = {"error": f"{type(error).__name__}: {error}"}
        else:
            payload = {"digest": digest(lines), "lines": lines, **(extra or {})}
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

    def agreed(self, where: str, payloads: list[dict], members: list[int], me: int) -> None:
        """Called when every member of a group published the same signature (``payloads`` by
        group rank; ``me``: this rank's); a subclass may compare more here."""

    def _verify_group(self, store, pg) -> None:
        prefix, world, me = self.keys[pg.group_name], dist.get_world_size(pg), dist.get_rank(pg)
        members = dist.get_process_group_ranks(pg)
        keys = [f"{prefix}/{r}" for r in range(world)]
        where = (f"process group {pg.group_name!r} (global ranks {members}), "
                 + self.subject.format(number=prefix.rsplit('/', 1)[-1]))
        try:
            store.wait(keys, _timeout())
        except Exception as error:  # noqa: BLE001 - the store's timeout error; named below
            missing = [members[r] for r in range(world) if not store.check([keys[r]])]
            raise RankMismatchError(
                f"opfuse: {where}: global rank(s) {missing} {self.absent} within {config.peer_timeout_ms} ms "
                f"(OPFUSE_PEER_TIMEOUT_MS); {self.absent_hint} ({error})") from None
        payloads = [json.loads(store.get(key)) for key in keys]
        failed = [(members[r], p["error"]) for r, p in enumerate(payloads) if "error" in p]
        if failed:
            listed = "; ".join(f"global rank {rank}: {text}" for rank, text in failed)
            raise RankMismatchError(f"opfuse: {where}: compiling failed on {listed}")
        mine = payloads[me]
        others = [r for r, p in enumerate(payloads) if p["digest"] != mine["digest"]]
        if not others:
            self.agreed(where, payloads, members, me)
            return
        # Every rank raises; each names the first line where a differing rank's signature departs.
        other = payloads[others[0]]
        first = next((i for i, (a, b) in enumerate(zip(mine["lines"], other["lines"])) if a != b),
                     min(len(mine["lines"]), len(other["lines"])))
        line = lambda p: p["lines"][first] if first < len(p["lines"]) else "(end of signature)"  # noqa: E731
        raise RankMismatchError(
            f"opfuse: {where}: {self.differ} (global ranks {[members[r] for r in others]} differ from global rank "
            f"{members[me]}); first difference:\n"
            f"  global rank {members[me]}: {line(mine)}\n"
            f"  global rank {members[others[0]]}: {line(other)}\n"
            f"{self.differ_hint}")
