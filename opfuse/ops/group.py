"""Process-group helpers shared by ops, passes and backend.

Ops accept ``group=None`` (the default group, resolved when first needed, so modules can be built
before ``init_process_group``) or a ``ProcessGroup``. Fused custom ops receive the group by name
(``ProcessGroup.group_name``), because torch.library schemas carry strings, not groups.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["GroupError", "check", "resolve", "group_name", "world_size", "rank", "from_name", "same_group"]


class GroupError(RuntimeError):
    """A parallel op was used without an initialised process group, with a group this process is
    not a member of, or with a group that changed size since the op was built."""


def check(group, who: str = "op"):
    """``group`` itself, if it is ``None`` or a ``ProcessGroup``; else a ``TypeError`` naming ``who``."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group() returns on ranks outside it
        raise GroupError(
            f"{who}: this process (global rank {dist.get_rank()}) is not a member of the group it was given "
            f"(torch.distributed.new_group returns a placeholder on the ranks it leaves out); build the op only on "
            f"the group's ranks")
    raise TypeError(
        f"{who}: group={group!r} is a {type(group).__name__}; expected a torch.distributed.ProcessGroup "
        f"(e.g. torch.distributed.new_group([...])) or None for the default group")


def resolve(group, who: str = "op"):
    """The ``ProcessGroup`` for ``group`` (``None`` = default group)."""
    if group is not None:
        return check(group, who)
    if not (dist.is_available() and dist.is_initialized()):
        raise GroupError(
            f"{who}: a tensor-parallel op needs torch.distributed; call "
            f"torch.distributed.init_process_group(...) first or pass group=..."
        )
    return dist.group.WORLD


def group_name(group) -> str:
    return resolve(group).group_name


def _member(group, who: str):
    pg = resolve(group, who)
    if dist.get_rank(pg) < 0:
        try:
            members = dist.get_process_group_ranks(pg)
        except Exception:  # noqa: BLE001 - only for the message
            members = "?"
        raise GroupError(
            f"{who}: this process (global rank {dist.get_rank()}) is not a member of process group "
            f"{pg.group_name!r} (global ranks {members}); build the op only on the group's ranks")
    return pg


def world_size(group, who: str = "op") -> int:
    return dist.get_world_size(_member(group, who))


def rank(group, who: str = "op") -> int:
    return dist.get_rank(_member(group, who))


def from_name(name: str):
    """The ``ProcessGroup`` registered under ``name``."""
    return dist.distributed_c10d._resolve_process_group(name)


def same_group(a, b) -> bool:
    return group_name(a) == group_name(b)
