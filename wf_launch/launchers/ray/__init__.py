"""``launcher=ray``: one Ray actor per rank in one placement group per attempt (docs/ray.md).

By role: :mod:`.cluster` (address, connecting, a private instance, fit), :mod:`.placement`
(bundles, each rank's node and environment), :mod:`.rank_entry` (on the nodes: the rank,
signals), :mod:`.attempt` (place, start, watch, teardown), :mod:`.failure` (the root cause),
:mod:`.monitor` (attempts, restarts, the record; the supervisor actor), :mod:`.submit` (the
launching command, a sweep), :mod:`.poll` (what the tools ask), :mod:`.state`
(``ray_run.json``), :mod:`.ray_adapter` (every Ray name). This module never imports Ray.
"""

from __future__ import annotations

import importlib.util
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ...config.engine import NCCL_BACKENDS
from ...config.fields import check_fields, config_error, flag, integer, number
from ...observe.stacks import rank_ranges
from ..base import WEEK_S, LauncherConfig, LauncherHooks
from ..ft_record import ft_status_lines
from ..ft_replicas import describe_ft
from ..registry import register_launcher
from . import state
from .cluster import parse_address
from .placement import LAUNCHER_VARS, shape
from .poll import cancel, kill_node, live_state, monitor_alive, signal_ranks, status
from .ray_adapter import INSTALL_HINT
from .submit import launch

if TYPE_CHECKING:
    from worldfoundry.core.distributed.topology import Layout

    from ...config.engine import EngineConfig
    from ...rundir.record import RunRecord
    from ..launch_plan import LaunchPlan

__all__ = ["RUNTIME_ENV_KEYS", "RayLauncher", "RayLauncherConfig", "validate_ray_launcher"]

RUNTIME_ENV_KEYS = ("env_vars", "pip", "working_dir", "excludes")
"""What ``launcher.runtime_env`` may hold (Ray's runtime environment fields of those names)."""


@dataclass
class RayLauncherConfig(LauncherConfig):
    """One Ray actor per rank, in one placement group (docs/ray.md)."""

    name: str = "ray"
    address: str | None = None
    nodes: int | None = integer(None, low=1, note="(null: anywhere)", optional=True)
    cpus_per_rank: float = number(
        1.0, 0, 1024, low_open=True, unit="CPUs", note="per rank (fractions allowed)"
    )
    gpus_per_rank: float = number(0.0, 0, 64, unit="GPUs", note="per rank")
    placement_timeout_s: float = number(60.0, 0, WEEK_S, low_open=True, unit="seconds")
    runtime_env: dict[str, Any] = field(default_factory=dict)
    wait: bool = flag(True)
    max_restarts: int = integer(0, low=0)
    shutdown_timeout_s: float = number(30.0, 0, 3600, unit="seconds")


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _check_env_vars(env_vars: Any) -> str | None:
    if not isinstance(env_vars, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()
    ):
        return "a mapping of names to strings"
    owned = sorted(k for k in env_vars if k in LAUNCHER_VARS)
    if owned:
        raise config_error(
            f"launcher.runtime_env.env_vars.{owned[0]}",
            env_vars[owned[0]],
            f"set by the launcher for every rank ({', '.join(LAUNCHER_VARS)})",
        )
    return None


def _check_working_dir(path: Any) -> str | None:
    """A URI (Ray fetches it), or a directory that exists here (Ray uploads it)."""
    if isinstance(path, str) and ("://" in path or Path(path).expanduser().is_dir()):
        return None
    return "a directory that exists on this machine, or a URI (s3://..., https://...zip)"


_RUNTIME_ENV_CHECKS = {  # field -> what is wrong with its value (None: nothing)
    "env_vars": _check_env_vars,
    "pip": lambda pip: (
        None
        if isinstance(pip, str) or _strings(pip)
        else "a list of requirements, or a requirements file's path"
    ),
    "working_dir": _check_working_dir,
    "excludes": lambda ex: None if _strings(ex) else "a list of paths or patterns to leave out",
}


def _validate_runtime_env(env: Any) -> None:
    """Each field of ``launcher.runtime_env`` by its own check (:data:`_RUNTIME_ENV_CHECKS`)."""
    allowed = f"a mapping with any of {list(RUNTIME_ENV_KEYS)} (Ray's runtime environment fields)"
    if not isinstance(env, dict):
        raise config_error("launcher.runtime_env", env, allowed)
    unknown = sorted(str(k) for k in env if k not in RUNTIME_ENV_KEYS)
    if unknown:
        raise config_error(f"launcher.runtime_env.{unknown[0]}", env[unknown[0]], allowed)
    for key, check in _RUNTIME_ENV_CHECKS.items():
        wrong = check(env[key]) if env.get(key) is not None else None
        if wrong:
            raise config_error(f"launcher.runtime_env.{key}", env[key], wrong)


def validate_ray_launcher(lc: RayLauncherConfig, engine: EngineConfig, world_size: int) -> None:
    """The Ray launcher's own fields, before the cluster is asked (:func:`~.cluster.check_fits`)."""
    if importlib.util.find_spec("ray") is None:
        raise config_error(
            "launcher",
            "ray",
            f"Ray is not installed in this environment; install it with: {INSTALL_HINT}",
        )
    parse_address(lc.address)
    check_fields(lc, "launcher")
    if lc.nodes is not None and world_size % lc.nodes:
        raise config_error(
            "launcher.nodes",
            lc.nodes,
            f"the layout's {world_size} rank(s) must split evenly "
            "over the nodes (consecutive ranks on one node); or null (anywhere)",
        )
    if lc.nodes is not None and lc.nodes > 1 and lc.address is None:
        raise config_error(
            "launcher.nodes",
            lc.nodes,
            "launcher.address=null runs a private Ray instance on this one machine; "
            "join a cluster of that many nodes with launcher.address=HOST:PORT",
        )
    if engine.backend in NCCL_BACKENDS and lc.gpus_per_rank < 1:
        raise config_error(
            "launcher.gpus_per_rank",
            lc.gpus_per_rank,
            f"engine.distributed_backend={engine.distributed_backend!r} needs a GPU per rank: "
            "at least 1; or use gloo",
        )
    if not lc.wait and lc.address is None:
        raise config_error(
            "launcher.wait",
            False,
            "a detached run needs a cluster that outlives this command: "
            "set launcher.address (a private instance ends with the command)",
        )
    _validate_runtime_env(lc.runtime_env)


def describe(plan: LaunchPlan) -> str:
    """The launch plan as text (``launcher.dry_run``): where, the placement group, each rank."""
    lc: RayLauncherConfig = plan.launcher_config
    where = (
        "a private Ray instance on this machine (started for the run, stopped after)"
        if lc.address is None
        else f"the Ray cluster at {lc.address}"
    )
    plan_shape = shape(plan.world_size, lc.nodes, lc.cpus_per_rank, lc.gpus_per_rank)
    per = plan_shape.ranks_per_bundle
    ranks = (
        f"{lc.nodes} node(s), ranks k*{per} .. k*{per}+{per - 1} on node k (rank 0 on the first)"
        if lc.nodes is not None
        else "anywhere, consecutive ranks together (rank 0 on the first node)"
    )
    return "\n".join(
        [
            f"launcher      ray, {plan.world_size} rank(s) on {where}",
            f"layout        {plan.layout.describe()}",
            f"task          {plan.task}",
            f"placement     one group per attempt: {plan_shape.describe()}; {ranks}",
            f"per rank      {lc.cpus_per_rank:g} CPU(s), {lc.gpus_per_rank:g} GPU(s); "
            "MASTER_ADDR/PORT on rank 0's node",
            f"runtime env   {dict(lc.runtime_env) or 'none (the cluster nodes environment)'}",
            f"placement timeout {lc.placement_timeout_s:g} s; max restarts {lc.max_restarts}; "
            f"wait {lc.wait}",
            f"run dir       {plan.run_dir} (every node must see it)",
            *describe_ft(plan, "its own placement group", "this machine's address in the cluster"),
        ]
    )


@register_launcher
class RayLauncher(LauncherHooks):
    """Ranks as Ray actors in a placement group (``launcher=ray``); detached with ``wait=false``."""

    name: ClassVar[str] = "ray"
    config_class: ClassVar[type[LauncherConfig]] = RayLauncherConfig
    drill_kinds: ClassVar[tuple[str, ...]] = ("kill9", "nodekill")
    supports_ft: ClassVar[bool] = True

    def validate(self, cfg: RayLauncherConfig, layout: Layout, engine: EngineConfig) -> None:
        validate_ray_launcher(cfg, engine, layout.world_size)

    describe = staticmethod(describe)
    launch = staticmethod(launch)
    status = staticmethod(status)
    cancel = staticmethod(cancel)
    kill_node = staticmethod(kill_node)
    live_state = staticmethod(live_state)

    def signal_ranks(self, run_dir: Path, signum: int) -> set[int]:
        """Every rank of the current attempt, on whichever node, through a Ray task per node."""
        return signal_ranks(Path(run_dir), signum)

    def signal_rank(self, run_dir: Path, rank: int, signum: int) -> bool:
        return rank in signal_ranks(Path(run_dir), signum, only=rank)

    def node_of(self, run_dir: Path, rank: int) -> str | None:
        """The Ray node id of the current attempt's ``rank``."""
        node = (state.placement_of(run_dir).get(rank) or {}).get("node")
        return str(node) if node else None

    def kill_rank(self, run_dir: Path, rank: int, progress: dict[int, dict[str, Any]]) -> str:
        """SIGKILL one rank on whichever node it runs."""
        if not self.signal_rank(run_dir, rank, signal.SIGKILL):
            raise ValueError(f"kill9:{rank}: rank {rank} of {run_dir} could not be reached")
        return f"pid {progress.get(rank, {}).get('pid')} (rank {rank})"

    def status_label(self, run_dir: Path) -> str:
        info = state.read(run_dir) or {}
        on = f" on {info['address']}" if info.get("address") and not info.get("private") else ""
        return f"Ray run {info.get('supervisor') or Path(run_dir).name}{on}"

    def status_details(self, run_dir: Path) -> list[str]:
        """Where each node's ranks ran (the current or last attempt); under ``ft=torchft`` each
        replica group's step, quorum and recovery."""
        if (state.read(run_dir) or {}).get("ft_replicas"):
            return ft_status_lines(Path(run_dir))
        by_node: dict[str, list[int]] = {}
        for rank, p in sorted(state.placement_of(run_dir).items()):
            where = f"node {str(p.get('node'))[:12]} (host {p.get('host')})"
            by_node.setdefault(where, []).append(rank)
        return [f"ranks {rank_ranges(r)} on {where}" for where, r in by_node.items()]

    def run_label(self, run_dir: Path, record: RunRecord | None) -> str:
        info = state.read(run_dir) or {}
        where = "private" if info.get("private") else info.get("address") or ""
        return f"ray {where}".strip() + (" detached" if info.get("detached") else "")

    def is_live(self, run_dir: Path) -> bool:
        return bool(state.read(run_dir)) and monitor_alive(Path(run_dir))
