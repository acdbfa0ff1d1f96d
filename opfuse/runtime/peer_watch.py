"""Bounded waits on peers, host side: turning a kernel's timeout record into an error.

Kernels that spin on other ranks' data (the residual-norm one-shot and two-shot all-reduces)
give up after ``opfuse.config.peer_timeout_ms`` (0 = never) and record the first wait that timed
out in host-mapped pinned memory (``runtime/csrc/peer_wait.h``). A :class:`PeerWatch` wraps one
region's record: :meth:`PeerWatch.check` reads it with a plain load (no stream sync) and raises
:class:`PeerTimeoutError` naming the op, the wait and the peer. The owners check before every
launch, so the call after a timeout raises, and so does every later one (the region's protocol
state is out of step with the peers for good); :func:`check_peers` checks every region, e.g.
after a step of CUDA-graph replays, which launch without Python.

The comm+GEMM overlap plans wait through torch symmetric memory's ``wait_signal`` / ``barrier``
with the same timeout; those trap (torch's own error, printed on the device), which ends the
process's CUDA context like an NCCL watchdog abort.
"""

from __future__ import annotations

from typing import Sequence

from ..config import config, env_name

__all__ = ["PeerTimeoutError", "PeerWatch", "check_peers", "timeout_ns"]


class PeerTimeoutError(RuntimeError):
    """A peer-memory kernel waited longer than ``opfuse.config.peer_timeout_ms`` for a peer."""


_WATCHES: list["PeerWatch"] = []


def timeout_ns() -> int:
    """The kernels' wait bound in nanoseconds (0 = wait forever)."""
    return config.peer_timeout_ms * 1_000_000


class PeerWatch:
    """One region's timeout record (``record``: the extension's ``PeerWatch``, or any object
    with ``failed()``, ``read()``, ``flag`` and ``record``).

    Parameters
    ----------
    record:
        The device-side watch; ``read()`` returns ``(failed, site, rank, peer, op, block, waited_ns)``.
    ops:
        Names of the op codes the kernels record (``ops[code]``).
    sites:
        ``{site name: code}`` of the waits (from the extension).
    group_ranks:
        Global rank of each rank of the region's group.
    what:
        The region, for messages (e.g. ``"residual_norm one-shot region of group 0"``).
    """

    def __init__(self, record, ops: Sequence[str], sites: dict, group_ranks: Sequence[int], what: str):
        self.record = record
        self.ops = tuple(ops)
        self.sites = {code: name for name, code in sites.items()}
        self.group_ranks = tuple(group_ranks)
        self.what = what
        #: Device addresses the launches take.
        self.flag, self.address = record.flag, record.record
        _WATCHES.append(self)

    def check(self) -> None:
        """Raise :class:`PeerTimeoutError` if a wait of this region timed out (now or before)."""
        if self.record.failed():
            raise self.error()

    def error(self) -> PeerTimeoutError:
        _, site, rank, peer, op, block, waited_ns = self.record.read()
        name = self.ops[op] if 0 <= op < len(self.ops) else f"op #{op}"
        where = self.sites.get(site, f"wait #{site}")
        global_peer = self.group_ranks[peer] if 0 <= peer < len(self.group_ranks) else "?"
        return PeerTimeoutError(
            f"opfuse {name}: rank {rank} of its group waited {waited_ns / 1e6:.0f} ms in the {where} for peer rank "
            f"{peer} (global rank {global_peer}), which never arrived ({env_name('peer_timeout_ms')} / "
            f"opfuse.config.peer_timeout_ms = {config.peer_timeout_ms}; block {block}). The peer died, hangs, or "
            f"stopped calling this op. The {self.what} is out of step with its peers now: every later call raises "
            f"this error; restart the ranks")


def check_peers() -> None:
    """Raise :class:`PeerTimeoutError` if any peer-memory wait of this process timed out.

    Calls of the fused ops check before they launch; call this after replaying CUDA graphs
    (``opfuse.graphed``), whose launches skip Python. Reads host memory only: no sync."""
    for watch in _WATCHES:
        watch.check()
