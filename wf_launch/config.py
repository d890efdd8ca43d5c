"""The run's config schema: structured dataclasses in Hydra's ConfigStore.

OmegaConf checks types when a value is set; ``validate_run_config`` checks values
(the way torchtitan's ``ParallelDims`` validates itself) and raises
:class:`ConfigError` naming the field, the value and what is allowed, before any
process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from worldfoundry.core.distributed.topology import DIMS, Layout, parse_order

BACKENDS = ("auto", "nccl", "gloo", "cpu:gloo,cuda:nccl")
START_METHODS = ("auto", "fork", "spawn", "forkserver")


class ConfigError(ValueError):
    """A config value is not allowed; the message names field, value and what is allowed."""


@dataclass
class EngineConfig:
    """How ranks are laid out and connected (read by ``dist_init``)."""

    distributed_backend: str = "auto"
    distributed_timeout_minutes: float = 30.0
    tp_size: int = 1
    cp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    order: str = "tp-cp-pp-dp"
    nccl_communicator_config_path: str | None = None


@dataclass
class LauncherConfig:
    """What every launcher has."""

    name: str = MISSING
    dry_run: bool = False
    console_ranks: list[int] | None = None


@dataclass
class LocalLauncherConfig(LauncherConfig):
    """Ranks as local processes on torch's elastic agent."""

    name: str = "local"
    start_method: str = "auto"
    max_restarts: int = 0
    threads_per_rank: int = 0
    rdzv_port: int = 0
    monitor_interval_s: float = 0.1
    shutdown_timeout_s: int = 5


@dataclass
class SlurmLauncherConfig(LauncherConfig):
    """One SLURM task per rank, submitted through submitit (docs/slurm.md)."""

    name: str = "slurm"
    nodes: int = 1
    tasks_per_node: int | None = None
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem_gb: float | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int = 60
    constraint: str | None = None
    exclude: str | None = None
    job_name: str = "wf_launch"
    sbatch_extra: dict[str, str] = field(default_factory=dict)
    setup: list[str] = field(default_factory=list)
    srun_args: list[str] = field(default_factory=list)
    folder: str = "submitit"
    wait: bool = True
    poll_interval_s: float = 1.0
    signal_delay_s: int = 90
    max_requeues: int = 3
    preempt_wait_s: float = 20.0


@dataclass
class TaskConfig:
    """Which registered task every rank runs; ``modules`` are imported first (user tasks)."""

    name: str = MISSING
    modules: list[str] = field(default_factory=list)


@dataclass
class RunConfig:
    """The whole run: ``engine``, ``launcher`` and ``task``."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    launcher: Any = MISSING
    task: Any = MISSING


def _fail(field_name: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{field_name}={value!r} is not allowed: {allowed}")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _fail(name, value, "expected an integer >= 1")


def validate_engine(engine: dict[str, Any]) -> Layout:
    """Check ``engine`` values and return its :class:`Layout`."""
    backend = str(engine.get("distributed_backend", "auto")).replace(" ", "").lower()
    if backend not in BACKENDS:
        raise _fail("engine.distributed_backend", engine.get("distributed_backend"),
                    f"choose one of {list(BACKENDS)}")
    timeout = engine.get("distributed_timeout_minutes")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise _fail("engine.distributed_timeout_minutes", timeout,
                    "expected a number of minutes > 0 (fractions allowed, e.g. 0.5)")
    for d in DIMS:
        _positive_int(f"engine.{d}_size", engine.get(f"{d}_size"))
    sizes = {d: engine[f"{d}_size"] for d in DIMS}
    world = 1
    for v in sizes.values():
        world *= v
    try:
        parse_order(engine.get("order"), sizes, world)
    except ValueError as exc:
        raise _fail("engine.order", engine.get("order"),
                    f"a '-'-joined permutation of {'/'.join(DIMS)} ({exc})") from None
    return Layout(world, **{f"{d}_size": v for d, v in sizes.items()}, order=engine["order"])


def validate_launcher(launcher: dict[str, Any], world_size: int,
                      engine: dict[str, Any] | None = None) -> None:
    """Check the launcher values common to every launcher, and the local or SLURM launcher's."""
    ranks = launcher.get("console_ranks")
    if ranks is not None:
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < world_size]
        if bad:
            raise _fail("launcher.console_ranks", list(ranks),
                        f"ranks must be integers in [0, {world_size - 1}] (null shows every rank)")
    if launcher.get("name") == "slurm":
        validate_slurm_launcher(launcher, engine or {}, world_size)
    if launcher.get("name") == "local":
        if launcher.get("start_method") not in START_METHODS:
            raise _fail("launcher.start_method", launcher.get("start_method"),
                        f"choose one of {list(START_METHODS)}")
        for key, low in (("max_restarts", 0), ("threads_per_rank", 0), ("rdzv_port", 0)):
            value = launcher.get(key)
            if not isinstance(value, int) or value < low:
                raise _fail(f"launcher.{key}", value, f"expected an integer >= {low}")
        if launcher["rdzv_port"] > 65535:
            raise _fail("launcher.rdzv_port", launcher["rdzv_port"], "expected 0 (pick a free port) or 1..65535")
        if not launcher.get("monitor_interval_s", 0) > 0:
            raise _fail("launcher.monitor_interval_s", launcher.get("monitor_interval_s"), "expected seconds > 0")
        if launcher.get("shutdown_timeout_s", -1) < 0:
            raise _fail("launcher.shutdown_timeout_s", launcher.get("shutdown_timeout_s"), "expected seconds >= 0")


NCCL_BACKENDS = ("nccl", "cpu:gloo,cuda:nccl")


def slurm_tasks_per_node(launcher: dict[str, Any], world_size: int) -> int:
    """``launcher.tasks_per_node``, or world size / nodes when it is null."""
    nodes = launcher["nodes"]
    if launcher.get("tasks_per_node") is not None:
        return int(launcher["tasks_per_node"])
    if world_size % nodes:
        raise _fail("launcher.nodes", nodes, f"the layout's {world_size} rank(s) must split evenly over "
                    "the nodes (or set launcher.tasks_per_node)")
    return world_size // nodes


def validate_slurm_launcher(launcher: dict[str, Any], engine: dict[str, Any], world_size: int) -> None:
    """SLURM launcher values, and that one SLURM task per rank covers the layout exactly."""
    _positive_int("launcher.nodes", launcher.get("nodes"))
    if launcher.get("tasks_per_node") is not None:
        _positive_int("launcher.tasks_per_node", launcher["tasks_per_node"])
    for key in ("cpus_per_task", "time_min", "signal_delay_s"):
        _positive_int(f"launcher.{key}", launcher.get(key))
    for key in ("gpus_per_node", "max_requeues"):
        value = launcher.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise _fail(f"launcher.{key}", value, "expected an integer >= 0")
    mem = launcher.get("mem_gb")
    if mem is not None and not mem > 0:
        raise _fail("launcher.mem_gb", mem, "expected GB > 0, or null for the partition's default")
    for key in ("poll_interval_s", "preempt_wait_s"):
        if not launcher.get(key, 0) > 0:
            raise _fail(f"launcher.{key}", launcher.get(key), "expected seconds > 0")
    if launcher["signal_delay_s"] >= launcher["time_min"] * 60:
        raise _fail("launcher.signal_delay_s", launcher["signal_delay_s"],
                    f"expected fewer seconds than the time limit ({launcher['time_min'] * 60} s)")
    if not str(launcher.get("folder") or "").strip():
        raise _fail("launcher.folder", launcher.get("folder"), "a folder name inside the run directory")
    tpn = slurm_tasks_per_node(launcher, world_size)
    if launcher["nodes"] * tpn != world_size:
        raise _fail("launcher.tasks_per_node", launcher.get("tasks_per_node"),
                    f"launcher.nodes ({launcher['nodes']}) x launcher.tasks_per_node ({tpn}) = "
                    f"{launcher['nodes'] * tpn} SLURM tasks, but the layout "
                    f"(tp*cp*pp*dp) has {world_size} rank(s); one task per rank")
    backend = str(engine.get("distributed_backend", "auto")).replace(" ", "").lower()
    if backend in NCCL_BACKENDS and launcher["gpus_per_node"] < tpn:
        raise _fail("launcher.gpus_per_node", launcher["gpus_per_node"],
                    f"engine.distributed_backend={engine.get('distributed_backend')!r} needs one GPU per "
                    f"task: at least launcher.tasks_per_node ({tpn}); or use gloo")


def validate_run_config(cfg: dict[str, Any]) -> Layout:
    """Check a resolved run config; returns the layout. Raises :class:`ConfigError`."""
    layout = validate_engine(cfg["engine"])
    validate_launcher(cfg["launcher"], layout.world_size, cfg["engine"])
    task = cfg.get("task") or {}
    if not isinstance(task.get("name"), str) or not task["name"]:
        raise _fail("task.name", task.get("name"), "the name of a registered task (task=NAME)")
    from .tasks.registry import get_task

    try:
        get_task(task["name"])
    except KeyError as exc:
        raise ConfigError(str(exc.args[0])) from None
    validator = getattr(get_task(task["name"]), "validate_config", None)
    if validator is not None:
        validator(task, cfg["engine"])
    return layout


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore (the YAML in ``conf/`` builds on it)."""
    from hydra.core.config_store import ConfigStore  # ranks never pay for importing Hydra

    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="engine", name="engine_schema", node=EngineConfig)
    cs.store(group="launcher", name="local_schema", node=LocalLauncherConfig)
    cs.store(group="launcher", name="slurm_schema", node=SlurmLauncherConfig)
    cs.store(group="task", name="task_schema", node=TaskConfig)
    from .tasks.registry import registered_configs

    for name, node in registered_configs().items():
        cs.store(group="task", name=name, node=node)
