"""Process groups of a parallel layout, as group objects every rank consumes.

``initialize_model_parallel`` turns a :class:`~.topology.Layout` into real process
groups (tp, cp, pp, dp and the combined tp-cp, dp-cp, tp-pp); ``get_*_group()``
hand out :class:`GroupCoordinator` objects; ``destroy_model_parallel`` destroys
every group it made and resets the state that hangs off them (PP scheduler, the
``cp_size_t`` that ``find_split`` records), so the process can be initialized again
with another layout. All of that state lives in the process's
:class:`~.runtime.Runtime` (``runtime.current()``); the functions here are thin
wrappers over it, and ``destroy_model_parallel`` is its ``close()``. This module
imports nothing built on top of it (CP, PP): those keep their state in the runtime.

Every rank walks every group in the same order (Megatron's way): ``new_group`` for
a group a rank is not in is a cheap local call, and group names stay unique, so
destroy-then-initialize with the same layout never meets stale rendezvous keys
(``use_local_synchronization`` names groups by their ranks and the number of live
groups, which repeats after a destroy; ``scripts/bench_groups.py`` measures both).
Groups with identical members are created once and shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import identity
from . import runtime as _rt
from .topology import COMBINED, DEFAULT_ORDER, DIMS, Layout

__all__ = [
    "GroupCoordinator",
    "destroy_model_parallel",
    "get_cp_group",
    "get_cp_size_t",
    "get_dp_cp_group",
    "get_dp_group",
    "get_group",
    "get_layout",
    "get_pp_group",
    "get_tp_cp_group",
    "get_tp_group",
    "get_tp_pp_group",
    "get_world_group",
    "init_distributed_environment",
    "initialize_model_parallel",
    "is_last_rank",
    "is_last_tp_cp_rank",
    "model_parallel_is_initialized",
]

_NOT_INITIALIZED = (
    "{what} is not initialized: call worldfoundry.core.distributed.dist_init(config) "
    "(or init_distributed_environment() then initialize_model_parallel(...)) first"
)


@dataclass
class GroupCoordinator:
    """One process group as seen from this rank.

    ``ranks`` are global ranks in group-rank order; ``next_rank`` / ``prev_rank``
    are ring neighbours (global ranks). ``device_group`` runs device collectives
    (NCCL on GPUs, gloo on CPU); ``cpu_group`` runs CPU tensors and objects: on
    NCCL it is a ``cpu:gloo,cuda:nccl`` group whose gloo half serves CPU tensors.
    """

    name: str
    ranks: list[int]
    rank: int
    device_group: Any
    cpu_group: Any

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def first_rank(self) -> int:
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        return self.rank == self.first_rank

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.last_rank

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def barrier(self) -> None:
        """Block until every member arrives (on the CPU group)."""
        dist.barrier(group=self.cpu_group)

    def __repr__(self) -> str:
        return f"GroupCoordinator({self.name}, ranks={self.ranks}, rank={self.rank})"


def _backend_of(group: Any) -> str:
    return str(dist.get_backend(group))


def init_distributed_environment(
    world_size: int = -1,
    rank: int = -1,
    distributed_init_method: str = "env://",
    local_rank: int = -1,
    backend: str = "gloo",
    timeout: timedelta | None = None,
    device_id: torch.device | None = None,
) -> GroupCoordinator:
    """Initialize the default process group (unless it is up) and the world group object.

    ``backend`` is any torch backend string (``gloo``, ``nccl``,
    ``cpu:gloo,cuda:nccl``). Rank and world size default to the environment
    (``env://``). Returns the world :class:`GroupCoordinator`.
    """
    rt = _rt.current()
    if _rt.init_default_group(
        backend, world_size, rank, distributed_init_method, timeout, device_id
    ):
        rt.owns_world = True
    if rt.world is None:
        default = dist.group.WORLD
        rt.world = GroupCoordinator(
            "world", list(range(identity.size())), identity.rank(), default, default
        )
    return rt.world


def initialize_model_parallel(
    tp_size: int = 1,
    pp_size: int = 1,
    cp_size: int = 1,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: float = 30,
    order: str = DEFAULT_ORDER,
    dp_size: int | None = None,
) -> None:
    """Build this rank's tp, cp, pp, dp, tp-cp, dp-cp and tp-pp groups.

    Megatron's rank layout: ``order`` is innermost-first. ``dp_size`` defaults to
    what the world leaves. Raises ValueError (naming order, sizes and world size)
    for a bad layout, and RuntimeError if groups already exist or the default
    process group is not up. ``nccl_communicator_config_path`` is a YAML file of
    per-group NCCL options (``min_ctas``, ``max_ctas``, ``cga_cluster_size``),
    applied to NCCL groups only.
    """
    if not identity.is_initialized():
        raise RuntimeError(_NOT_INITIALIZED.format(what="torch.distributed"))
    rt = _rt.current()
    if rt.layout is not None:
        raise RuntimeError(
            f"model parallel groups already exist ({rt.layout.describe()}); "
            "call destroy_model_parallel() before initializing another layout"
        )
    world_size, me = identity.size(), identity.rank()
    layout = Layout(
        world_size, tp_size=tp_size, cp_size=cp_size, pp_size=pp_size, dp_size=dp_size, order=order
    )
    init_distributed_environment()
    timeout = timedelta(minutes=float(distributed_timeout_minutes))
    backend = _backend_of(None)
    nccl_options = _load_nccl_options(nccl_communicator_config_path) if "nccl" in backend else {}

    by_members: dict[tuple[int, ...], Any] = {tuple(range(world_size)): dist.group.WORLD}
    groups: dict[str, GroupCoordinator] = {}
    try:
        for name in (*DIMS, *COMBINED):
            options = _pg_options(nccl_options.get(name.replace("-", "_")))
            for members in layout.groups(name):
                key = tuple(members)
                if key in by_members:
                    continue
                pg = dist.new_group(
                    members, timeout=timeout, backend=backend, pg_options=options, group_desc=name
                )
                by_members[key] = pg
                if me in members:
                    rt.created.append(pg)
            members = layout.group_of(me, name)
            pg = by_members[tuple(members)]
            groups[name] = GroupCoordinator(name, members, me, pg, pg)
    except BaseException:
        rt.destroy_created()
        raise
    rt.layout, rt.groups = layout, groups


def _load_nccl_options(path: str | None) -> dict[str, dict[str, int]]:
    if not path:
        return {}
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(
            f"nccl_communicator_config_path={path!r}: expected a mapping of group name "
            f"to options, got {type(data).__name__}"
        )
    return data


def _pg_options(opts: dict[str, int] | None) -> Any:
    if not opts:
        return None
    pg_opts = dist.ProcessGroupNCCL.Options()
    for key in ("min_ctas", "max_ctas", "cga_cluster_size"):
        if key in opts:
            setattr(pg_opts.config, key, int(opts[key]))
    return pg_opts


def model_parallel_is_initialized() -> bool:
    """Whether ``initialize_model_parallel`` has built the groups (and they are not destroyed)."""
    return _rt.current().layout is not None


def destroy_model_parallel() -> None:
    """Destroy every group ``initialize_model_parallel`` made and reset dependent state.

    Closes the runtime (:meth:`.runtime.Runtime.close`): also resets the PP
    scheduler, ``cp_size_t`` and what ``broadcast_split_tensor`` remembers of each
    group's last header. The default process group is destroyed only if
    ``init_distributed_environment`` created it. Safe to call when nothing is
    initialized.
    """
    _rt.current().close()


def get_layout() -> Layout:
    """The layout ``initialize_model_parallel`` built."""
    layout = _rt.current().layout
    if layout is None:
        raise RuntimeError(_NOT_INITIALIZED.format(what="model parallel"))
    return layout


def _group(name: str) -> GroupCoordinator:
    rt = _rt.current()
    if rt.layout is None:
        raise RuntimeError(_NOT_INITIALIZED.format(what=f"the {name} group"))
    return rt.groups[name]


def get_world_group() -> GroupCoordinator:
    """All ranks."""
    world = _rt.current().world
    if world is None:
        raise RuntimeError(_NOT_INITIALIZED.format(what="the world group"))
    return world


def get_tp_group() -> GroupCoordinator:
    """This rank's tensor-parallel group."""
    return _group("tp")


def get_cp_group() -> GroupCoordinator:
    """This rank's context-parallel group."""
    return _group("cp")


def get_pp_group() -> GroupCoordinator:
    """This rank's pipeline-parallel group."""
    return _group("pp")


def get_dp_group() -> GroupCoordinator:
    """This rank's data-parallel group."""
    return _group("dp")


def get_tp_cp_group() -> GroupCoordinator:
    """This rank's combined tensor- and context-parallel group."""
    return _group("tp-cp")


def get_dp_cp_group() -> GroupCoordinator:
    """This rank's combined data- and context-parallel group (weight-gradient reduction)."""
    return _group("dp-cp")


def get_tp_pp_group() -> GroupCoordinator:
    """This rank's model-parallel group (tensor and pipeline)."""
    return _group("tp-pp")


def get_group(name: str) -> GroupCoordinator:
    """Group by name: 'world', 'tp', 'cp', 'pp', 'dp', 'tp-cp', 'dp-cp' or 'tp-pp'."""
    if name == "world":
        return get_world_group()
    if name not in (*DIMS, *COMBINED):
        raise ValueError(f"unknown group {name!r}; allowed: {['world', *DIMS, *COMBINED]}")
    return _group(name)


def is_last_rank() -> bool:
    """Whether this is the last global rank (True in a single process)."""
    return identity.rank() == identity.size() - 1


def is_last_tp_cp_rank() -> bool:
    """Whether this is the last rank of its combined tp-cp group (True in a single process)."""
    if _rt.current().layout is None:
        if identity.size() > 1:
            raise RuntimeError(_NOT_INITIALIZED.format(what="the tp-cp group"))
        return True
    return _group("tp-cp").is_last_rank


def get_cp_size_t() -> int | None:
    """CP ranks the last ``find_split`` gave to the time axis (None before any)."""
    return _rt.current().cp_size_t
