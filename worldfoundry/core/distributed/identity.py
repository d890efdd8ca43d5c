"""Who this process is in a run: the one place to ask for its rank, the run's size, its groups.

``rank()`` and ``size()`` read the live process group (0 of 1 without one);
:class:`DistributedProcessGroup` and :class:`ParallelState` wrap groups a caller
holds (the run-control API's wrappers) and ask the same two functions. The layout's own groups
(:mod:`.groups`) and run control (:mod:`.run_control`) use them too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..validation import is_int
from .env import env_int

__all__ = [
    "DistributedProcessGroup",
    "ParallelState",
    "backend",
    "barrier",
    "is_available",
    "is_distributed_launch",
    "is_distributed_run",
    "is_initialized",
    "is_master",
    "rank",
    "size",
]

_Group = Any  # a torch.distributed.ProcessGroup or None (the world)


def is_available() -> bool:
    """Returns whether the distributed package is available."""
    return dist.is_available()


def is_initialized() -> bool:
    """Returns whether the distributed package is initialized."""
    return dist.is_available() and dist.is_initialized()


def is_distributed_launch() -> bool:
    """True if launched distributed (WORLD_SIZE>1), readable BEFORE the process group is set up.

    Env-based, so parse-time code can tell the launch mode before ``distributed_run()``
    sets the group up; once it has, ``is_distributed_run()`` reads the live group.
    """
    return env_int("WORLD_SIZE", 1) > 1


def is_distributed_run() -> bool:
    """True if a real multi-rank job is running: the group is initialized and world size > 1."""
    return is_initialized() and dist.get_world_size() > 1


def rank(group: _Group = None) -> int:
    """Returns the rank of the current process (0 without an initialized group)."""
    return dist.get_rank(group) if is_initialized() else 0


def size(group: _Group = None) -> int:
    """Returns the number of processes (1 without an initialized group)."""
    return dist.get_world_size(group) if is_initialized() else 1


def is_master(group: _Group = None) -> bool:
    """Returns whether the current process is the master process (rank 0 of ``group``)."""
    return rank(group) == 0


def backend() -> str | None:
    """Returns the distributed backend, or None without an initialized group."""
    return dist.get_backend() if is_initialized() else None


def barrier(group: _Group = None) -> None:
    """Synchronizes all processes of ``group``; a no-op without an initialized group."""
    if is_initialized():
        dist.barrier(group=group)


class DistributedProcessGroup:
    """A convenient wrapper around torch.distributed.ProcessGroup objects.

    ``group`` is a ProcessGroup, ``None`` for the default (world) group, or ``-1`` for a
    parallelism that is not used; an unused group reports rank and size ``-1``, and so
    does a group this rank is not a member of (``new_group``'s ``NON_GROUP_MEMBER``).
    """

    def __init__(self, group: dist.ProcessGroup | int | None = None) -> None:
        allowed = (-1, dist.GroupMember.NON_GROUP_MEMBER)
        if isinstance(group, bool) or (is_int(group) and group not in allowed):
            raise ValueError(
                f"DistributedProcessGroup: group={group!r} is not allowed; "
                "pass a ProcessGroup, None (the world) or -1 (unused)"
            )
        if not (group is None or isinstance(group, (int, dist.ProcessGroup))):
            raise TypeError(
                f"DistributedProcessGroup: group must be a ProcessGroup, None or -1, "
                f"got {type(group).__name__}"
            )
        self.group = group

    def is_initialized(self) -> bool:
        """Check if the distributed process group is initialized (and used)."""
        return is_initialized() and not isinstance(self.group, int)

    def rank(self) -> int:
        """Get the rank of the current process group (-1 when unused or not initialized)."""
        return rank(self.group) if self.is_initialized() else -1

    def world_size(self) -> int:
        """Get the world size of the current process group (-1 when unused or not initialized)."""
        return size(self.group) if self.is_initialized() else -1

    def __repr__(self) -> str:
        return f"DistributedProcessGroup(rank={self.rank()}, world_size={self.world_size()})"

    @staticmethod
    def get_dist_syncd_obj(
        obj: Any,
        groups: DistributedProcessGroup | list[DistributedProcessGroup],
        op: Callable[[list[Any]], Any],
    ) -> Any:
        """``obj`` synchronized across ``groups``: each group's gathered values folded by ``op``.

        Groups are applied in order; unused or single-rank groups leave ``obj`` as it is.
        """
        group_list = groups if isinstance(groups, list) else [groups]
        for g in group_list:
            if not isinstance(g, DistributedProcessGroup):
                raise TypeError(
                    "get_dist_syncd_obj: groups must hold DistributedProcessGroup, "
                    f"got {type(g).__name__}"
                )
            if not g.is_initialized() or g.world_size() <= 1:
                continue
            objs: list[Any] = [None] * g.world_size()
            dist.all_gather_object(objs, obj, group=g.group)
            obj = op(objs)
        return obj


class ParallelState:
    """A class to manage various parallel groups such as data parallel, tensor parallel etc.

    A group set to -1 is not used; a group set to None is the default (world) group.
    """

    def __init__(
        self,
        data_parallel_group: dist.ProcessGroup | int | None = None,
        tensor_parallel_group: dist.ProcessGroup | int | None = -1,
        expert_model_parallel_group: dist.ProcessGroup | int | None = -1,
    ) -> None:
        self.data_parallel_group = DistributedProcessGroup(data_parallel_group)
        self.tensor_parallel_group = DistributedProcessGroup(tensor_parallel_group)
        self.expert_model_parallel_group = DistributedProcessGroup(expert_model_parallel_group)

    def __repr__(self) -> str:
        return (
            f"ParallelState(data_parallel_group={self.data_parallel_group!r}, "
            f"tensor_parallel_group={self.tensor_parallel_group!r}, "
            f"expert_model_parallel_group={self.expert_model_parallel_group!r})"
        )
