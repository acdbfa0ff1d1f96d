"""Process-group helpers shared by ops, passes and backend.

Ops accept ``group=None`` (the default group, resolved when first needed, so modules can be built
before ``init_process_group``) or a ``ProcessGroup``. Fused custom ops receive the group by name
(``ProcessGroup.group_name``), because torch.library schemas carry strings, not groups.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["GroupError", "resolve", "group_name", "world_size", "rank", "from_name", "same_group"]


class GroupError(RuntimeError):
    """A parallel op was used without an initialised process group."""


def resolve(group, who: str = "op"):
    """The ``ProcessGroup`` for ``group`` (``None`` = default group)."""
    if group is not None:
        return group
    if not (dist.is_available() and dist.is_initialized()):
        raise GroupError(
            f"{who}: a tensor-parallel op needs torch.distributed; call "
            f"torch.distributed.init_process_group(...) first or pass group=..."
        )
    return dist.group.WORLD


def group_name(group) -> str:
    return resolve(group).group_name


def world_size(group) -> int:
    return dist.get_world_size(resolve(group))


def rank(group) -> int:
    return dist.get_rank(resolve(group))


def from_name(name: str):
    """The ``ProcessGroup`` registered under ``name``."""
    return dist.distributed_c10d._resolve_process_group(name)


def same_group(a, b) -> bool:
    return group_name(a) == group_name(b)
