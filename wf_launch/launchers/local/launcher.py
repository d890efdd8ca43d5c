"""Local ranks on torch's elastic agent (see :mod:`.agent`), one process per rank.

Rendezvous is c10d on ``127.0.0.1:0`` (the OS picks a free port, so concurrent
launches never collide) unless ``launcher.rdzv_port`` names one. ``start_method:
auto`` forks from this process, which has imported torch but never run a torch op
or touched CUDA; it falls back to spawn where fork is unsafe. By the time the
agent forks, it runs threads of its own (the rendezvous stores' servers), so a
forked rank waits at a :class:`~.agent.ForkGate` until every rank is forked.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from loguru import logger

from worldfoundry.core.distributed.backends import local_gpu_count

from ...config.engine import NCCL_BACKENDS
from ...config.fields import (
    check_fields,
    choice,
    config_error,
    flag,
    integer,
    number,
)
from ...observe.interrupt import raise_if_interrupted
from ...observe.live import progress_monitor
from ...observe.rootcause import explain_failure
from ...observe.watch import RankWatch, StartupTimeout
from ...rank.entrypoint import RankSpec
from ...rank.ft import ft_enabled
from ...rank.task_registry import task_preload
from ...rundir import attempts, files
from ...rundir.environment import record_environment
from ...rundir.outcome import RunOutcome
from ...rundir.placement import read_placement
from ...rundir.record import RunRecord, Status
from ...rundir.space import disk_full, full_disk_error
from ..base import LauncherConfig, LauncherHooks
from ..ft_record import ft_status_lines
from ..ft_replicas import describe_ft
from ..interrupt import interrupted, name_ctrl_c
from ..registry import register_launcher
from .rank_entry import local_rank_entry
from .replicas import launch_replicas

if TYPE_CHECKING:
    from worldfoundry.core.distributed.topology import Layout

    from ...config.engine import EngineConfig
    from ..launch_plan import LaunchPlan

__all__ = [
    "LocalLauncher",
    "LocalLauncherConfig",
    "check_gpus",
    "choose_start_method",
    "threads_per_rank",
]

START_METHODS = ("auto", "fork", "spawn", "forkserver")
RANKS_PER_CORE = 64
"""Local ranks allowed per core without ``launcher.oversubscribe=true`` (128 on a 2-core machine).
"""


@dataclass
class LocalLauncherConfig(LauncherConfig):
    """Ranks as local processes on torch's elastic agent."""

    name: str = "local"
    start_method: str = choice("auto", START_METHODS)
    max_restarts: int = integer(0, low=0)
    threads_per_rank: int = integer(0, low=0)
    rdzv_port: int = integer(0, 0, 65535, note="(0: pick a free port)")
    monitor_interval_s: float = number(0.1, 0, 60, low_open=True, unit="seconds")
    shutdown_timeout_s: int = number(30, 0, 3600, unit="seconds")
    loopback_only: bool = flag(True)
    oversubscribe: bool = flag(False)

    def check(self, world_size: int) -> None:
        """The local launcher's own fields, and that the world fits this host."""
        check_fields(self, "launcher")
        cores = os.cpu_count() or 1
        if world_size > RANKS_PER_CORE * cores and not self.oversubscribe:
            raise config_error(
                "engine (tp_size*cp_size*pp_size*dp_size)",
                world_size,
                f"the layout has {world_size} ranks, more than {RANKS_PER_CORE} per core on this "
                f"{cores}-core host ({RANKS_PER_CORE * cores}); use launcher=slurm for more, or "
                "pass launcher.oversubscribe=true to start them here anyway",
            )


def check_gpus(engine: EngineConfig, world_size: int) -> None:
    """An NCCL backend needs a GPU per rank on this host: refused before launch if it has fewer."""
    if engine.backend not in NCCL_BACKENDS:
        return
    gpus = local_gpu_count()
    if gpus < world_size:
        raise config_error(
            "engine.distributed_backend",
            engine.distributed_backend,
            f"NCCL needs a GPU per rank: the layout has {world_size} rank(s) and this host "
            f"{gpus} GPU(s); use gloo here, or a launcher whose nodes have GPUs",
        )


def preload(modules: tuple[str, ...]) -> None:
    """Import what the task's ranks will import (``register_task(preload=...)``), so forked ranks
    inherit it.

    A module that fails to import is left to the ranks, which report the error where it matters.
    """
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            logger.debug(f"preload of {name!r} failed ({exc!r}); the ranks import it themselves")


def choose_start_method(requested: str) -> str:
    """``auto`` -> fork where it is safe (Linux, one thread, no CUDA device), else spawn.

    With a GPU, counting the devices may already have asked the CUDA runtime (torch does where NVML
    is unavailable, as in gVisor sandboxes), and a forked rank then cannot use CUDA ("Cannot
    re-initialize CUDA in forked subprocess", seen on an H200): GPU hosts spawn their ranks.
    """
    if requested != "auto":
        return requested
    if not sys.platform.startswith("linux") or threading.active_count() > 1:
        return "spawn"
    return "spawn" if local_gpu_count() > 0 else "fork"


def threads_per_rank(requested: int, nproc: int) -> int:
    """Torch threads for each rank: ``requested``, or the cores shared out (at least 1)."""
    if requested > 0:
        return requested
    return max(1, (os.cpu_count() or 1) // max(1, nproc))


def describe(plan: LaunchPlan) -> str:
    """The launch plan as text (for ``launcher.dry_run``)."""
    lc: LocalLauncherConfig = plan.launcher_config
    nproc = plan.world_size
    port = lc.rdzv_port or "a free port (0)"
    return "\n".join(
        [
            f"launcher      local (torch elastic agent), {nproc} rank process(es) on this host",
            f"layout        {plan.layout.describe()}",
            f"task          {plan.task}",
            f"rendezvous    c10d at 127.0.0.1:{port}",
            f"start method  {choose_start_method(lc.start_method)} (requested {lc.start_method})",
            f"threads/rank  {threads_per_rank(lc.threads_per_rank, nproc)}",
            f"max restarts  {lc.max_restarts}",
            f"run dir       {plan.run_dir}",
            f"rank logs     {files.rank_log(plan.run_dir, 0).parent}/rank{{0..{nproc - 1}}}.log",
            *describe_ft(plan, "its own agent, store and groups", "127.0.0.1"),
        ]
    )


class _ToLoguru(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        logger.opt(depth=6).log("DEBUG", f"[{record.name}] {record.getMessage()}")


def _route_elastic_logs() -> None:
    """torch's agent and its process contexts log to the launcher log, never the console (their
    'Terminating process ... via signal SIGTERM' is how every failed run's survivors stop)."""
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        torch_logger = logging.getLogger(name)
        torch_logger.handlers[:] = [_ToLoguru()]
        torch_logger.setLevel(logging.INFO)
        torch_logger.propagate = False


SEPARATE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""torch elastic's switch that makes rank 0 start a second store for the ranks instead of sharing
the agent's.
"""


def _share_the_loopback_store() -> None:
    """The ranks share the launcher's loopback store: :data:`SEPARATE_STORE_ENV` is dropped, with a
    warning.

    With it, rank 0 starts a second store on a port the agent picked and released (another
    process can take it in between) and, in torch's own code, listens on every interface.
    """
    value = os.environ.pop(SEPARATE_STORE_ENV, None)
    if value not in (None, "", "0"):
        logger.warning(
            f"{SEPARATE_STORE_ENV}={value} ignored: with launcher.loopback_only=true "
            "the ranks share the launcher's store on 127.0.0.1 "
            "(set launcher.loopback_only=false to keep it)"
        )


def shutdown_timeout(launch_config: type, seconds: int) -> dict[str, int]:
    """``{"shutdown_timeout": seconds}`` where torch's ``LaunchConfig`` takes it; older torch (2.11
    here) has no such field and gives the workers its fixed 30 s after the stop signal."""
    if "shutdown_timeout" not in inspect.signature(launch_config).parameters:
        return {}
    return {"shutdown_timeout": int(seconds)}


def _launch_config(plan: LaunchPlan, method: str) -> Any:
    """torch's ``LaunchConfig`` for the plan: one node, loopback c10d rendezvous, the launcher's
    settings.
    """
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    lc: LocalLauncherConfig = plan.launcher_config
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=plan.world_size,
        run_id=f"wf-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{lc.rdzv_port}",
        rdzv_configs={"timeout": 120},
        max_restarts=lc.max_restarts,
        monitor_interval=lc.monitor_interval_s,
        start_method=method,
        logs_specs=DefaultLogsSpecs(log_dir=str(plan.run_dir / files.ELASTIC_LOGS)),
        local_addr="127.0.0.1",
        **shutdown_timeout(LaunchConfig, lc.shutdown_timeout_s),
    )


def _prepare(plan: LaunchPlan) -> tuple[Any, RankSpec, str]:
    """Preload, threads, environment and torch's launch config; (config, the ranks' spec, start
    method).
    """
    lc: LocalLauncherConfig = plan.launcher_config
    nproc = plan.world_size
    if lc.start_method in ("auto", "fork"):
        preload(task_preload(plan.task))
    method = choose_start_method(lc.start_method)
    threads = threads_per_rank(lc.threads_per_rank, nproc)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if lc.loopback_only:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        _share_the_loopback_store()
    _route_elastic_logs()
    spec = RankSpec(
        config=plan.config,
        run_dir=str(plan.run_dir),
        threads_per_rank=threads,
        console_ranks=lc.console_ranks,
        launch_time=time.time(),
        max_log_mb=float(lc.max_log_mb or 0),
        attempt_base=attempts.count(plan.run_dir),
    )  # > 0 when launcher.resume continues a run
    return _launch_config(plan, method), spec, method


def launch(
    plan: LaunchPlan, on_restart: Callable[[int, dict[int, int]], None] | None = None
) -> RunOutcome:
    """Start every rank, wait for them, and record the outcome in the run directory.

    Ctrl-C or SIGTERM at any point (the task's modules still importing, the ranks starting or
    running) ends with an ``interrupted`` record that says how to resume. ``on_restart(n,
    exit_codes)``: called before the ranks' ``n``-th restart with the failed ranks' exit codes
    (``ft=torchft`` records a replica group's failures with it).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    # torch's elastic agent: status and runs load this launcher for its hooks, never the agent
    from .agent import PortInUse, RanksFailed

    tracker = _AttemptTracker(plan.run_dir, plan.world_size, attempts.count(plan.run_dir))
    info: dict[str, Any] = plan.run_info()
    t0 = time.time()
    try:
        _start_and_wait(plan, info, tracker, on_restart)
    except PortInUse as exc:
        return _port_in_use(plan, info, exc)
    except RanksFailed as exc:
        info["attempts"] = tracker.close(attempts.cause_of_exits(exc.exit_codes))
        info["placement"] = read_placement(plan.run_dir, plan.world_size)
        return _failed(plan, info, exc.exit_codes, time.time() - t0, exc.dumps)
    except StartupTimeout as exc:
        info["attempts"], info["placement"] = (
            tracker.close("start-up timeout"),
            read_placement(plan.run_dir, plan.world_size),
        )
        return _startup_timeout(plan, info, exc, time.time() - t0)
    except (SignalException, KeyboardInterrupt) as exc:
        info["placement"] = read_placement(plan.run_dir, plan.world_size)
        return _interrupted(
            plan, info, tracker, signal.Signals(getattr(exc, "sigval", signal.SIGINT)).name, t0
        )
    info["attempts"], info["placement"] = (
        tracker.close("completed"),
        read_placement(plan.run_dir, plan.world_size),
    )
    record = RunRecord.finalize(
        plan.run_dir, Status.OK, **info, timings={"wall_s": round(time.time() - t0, 4)}
    )
    return RunOutcome.of(record, plan.run_dir)


def _start_and_wait(
    plan: LaunchPlan,
    info: dict[str, Any],
    tracker: _AttemptTracker,
    on_restart: Callable[[int, dict[int, int]], None] | None = None,
) -> None:
    """Preload, record the environment, start the ranks on the agent and wait for them (raises how
    it ended).
    """
    # torch's elastic agent, imported once ranks are about to start (see _launch)
    from .agent import ForkGate, run_agent

    config, spec, method = _prepare(plan)
    raise_if_interrupted()  # one that an import above swallowed (torch's have bare excepts)
    logger.info(
        f"launching {plan.world_size} rank(s): {plan.layout.describe()}, task={plan.task}, "
        f"start method {method}, run dir {plan.run_dir}"
    )
    info["environment"] = record_environment(plan.run_dir)
    gate = ForkGate()
    # Progress is shown from the agent's own loop (RankWatch.tick), never from a thread: the
    # launcher forks the ranks, and a forking process should run no threads of its own.
    monitor = progress_monitor(
        plan.run_dir,
        plan.config,
        plan.label,
        write=logger.info,
        warn=logger.warning,
        since=time.time(),  # a resumed run's first line is this attempt's, with its total
    )
    watch = RankWatch(
        plan.run_dir,
        plan.world_size,
        plan.label,
        float(plan.config["engine"]["init_timeout_s"]),
        write=logger.info,
        progress=monitor,
    )
    try:
        run_agent(
            config,
            local_rank_entry,
            spec,
            os.getpid(),
            gate,
            gate=gate,
            loopback_only=plan.launcher_config.loopback_only,
            watch=watch,
            on_start=tracker.on_start if on_restart is None else _both(tracker, on_restart),
            kill_survivors=ft_enabled(plan.config),
        )
    finally:
        monitor.stop()


def _both(
    tracker: _AttemptTracker, on_restart: Callable[[int, dict[int, int]], None]
) -> Callable[[int, dict[int, int]], None]:
    """The agent's start hook: the attempt record, and on a restart ``on_restart``."""

    def on_start(n: int, exit_codes: dict[int, int]) -> None:
        if n > 0:
            on_restart(n, exit_codes)
        tracker.on_start(n, exit_codes)

    return on_start


class _AttemptTracker:
    """The launcher's part of the attempt records (:mod:`wf_launch.rundir.attempts`): each start of
    the ranks is an attempt (numbered on from ``base``); when one ends, what rank 0 could not record
    is filled in."""

    def __init__(self, run_dir: Any, world_size: int, base: int) -> None:
        self.run_dir, self.world_size, self.base = run_dir, world_size, base
        self.current: int | None = None

    def on_start(self, n: int, exit_codes: dict[int, int]) -> None:
        """Before the ranks' ``n``-th start: close the attempt that crashed (its failed ranks'
        ``exit_codes``).
        """
        if self.current is not None:
            cause = attempts.cause_of_exits(exit_codes)
            self._write(lambda: attempts.close(self.run_dir, self.current, self.world_size, cause))
        self.current = self.base + n

    def _write(self, write: Any) -> Any:
        """``write()``; None when the marker cannot be written (a full disk): the attempt records
        are the launcher's notes, never a reason to lose the run's final record."""
        try:
            return write()
        except OSError as exc:
            logger.warning(f"could not write an attempt marker in {self.run_dir} ({exc})")
            return None

    def close(self, ended_by: str, ctrl_c: bool = False) -> list[dict[str, Any]]:
        """The last attempt ended (``ended_by``, unless rank 0 said why): every attempt's entry.

        ``ctrl_c``: the agent passed a Ctrl-C on to the ranks as SIGTERM (the stop flag's
        signal); the record calls the stop by its name.
        """
        current = self.current
        if current is not None:
            marker = self._write(
                lambda: attempts.close(self.run_dir, current, self.world_size, ended_by)
            )
            if ctrl_c and marker is not None:
                self._write(lambda: name_ctrl_c(self.run_dir, current))
        return attempts.collect(self.run_dir)


def _port_in_use(plan: LaunchPlan, info: dict[str, Any], exc: Exception) -> RunOutcome:
    print(f"wf_launch: {exc}", file=sys.stderr, flush=True)
    record = RunRecord.finalize(
        plan.run_dir,
        Status.INVALID,
        **info,
        failure={"cause": "invalid_config", "message": str(exc)},
    )
    return RunOutcome.of(record, plan.run_dir, "")


def _interrupted(
    plan: LaunchPlan, info: dict[str, Any], tracker: _AttemptTracker, name: str, t0: float
) -> RunOutcome:

    started = tracker.current is not None
    summary = (
        f"interrupted by {name}: every rank was stopped"
        if started
        else f"interrupted by {name} while the run was starting: no rank had started"
    )
    logger.debug(summary)
    info["attempts"] = tracker.close(name, ctrl_c=name == "SIGINT")
    timings = {"wall_s": round(time.time() - t0, 4)}
    return interrupted(plan.run_dir, name, summary, **info, timings=timings)


def _startup_timeout(plan: LaunchPlan, info: dict[str, Any], exc: Any, wall: float) -> RunOutcome:
    failure, summary = exc.failure(plan.run_dir, plan.label, plan.layout.coords)
    record = RunRecord.finalize(
        plan.run_dir, Status.FAILED, **info, failure=failure, timings={"wall_s": round(wall, 4)}
    )
    return RunOutcome.of(record, plan.run_dir, summary)


def _failed(
    plan: LaunchPlan,
    info: dict[str, Any],
    exits: dict[int, int],
    wall: float,
    dumps: dict[int, Any] | None = None,
) -> RunOutcome:
    explained = explain_failure(
        plan.run_dir, exits, plan.label, plan.layout.coords, plan.world_size, dumps
    )
    if explained is None:
        cause = {
            "rank": -1,
            "cause": "unknown",
            "type": "Unknown",
            "message": "no rank reported a failure",
        }
        summary = "run failed, but no rank left a failure record"
    else:
        cause, summary = explained
    cause, summary = _note_full_disk(plan.run_dir, cause, summary)
    logger.debug(f"run failed: {summary}")
    record = RunRecord.finalize(
        plan.run_dir,
        Status.FAILED,
        **info,
        failure=cause,
        exits={str(k): v for k, v in exits.items()},
        timings={"wall_s": round(wall, 4)},
    )
    return RunOutcome.of(record, plan.run_dir, summary)


def _note_full_disk(
    run_dir: Any, cause: dict[str, Any], summary: str
) -> tuple[dict[str, Any], str]:
    """The cause and summary, saying the disk is full when it is and they do not already: a
    rank on a full disk may have left no record, only its exit code."""
    if "[Errno 28]" in str(cause.get("message")) or not disk_full(run_dir):
        return cause, summary
    full = str(full_disk_error(run_dir, "a rank may have failed for want of space"))
    if cause.get("cause") == "unknown":
        return {**cause, "cause": "disk_full", "type": "OSError", "message": full}, full
    return {**cause, "disk_full": full}, f"{summary}\n  the disk is full: {full}"


@register_launcher
class LocalLauncher(LauncherHooks):
    """Ranks as processes on this machine, on torch's elastic agent (``launcher=local``)."""

    name: ClassVar[str] = "local"
    config_class: ClassVar[type[LauncherConfig]] = LocalLauncherConfig
    drill_kinds: ClassVar[tuple[str, ...]] = ("kill9", "sigterm")
    supports_ft: ClassVar[bool] = True

    def validate(self, cfg: LocalLauncherConfig, layout: Layout, engine: EngineConfig) -> None:
        cfg.check(layout.world_size)
        check_gpus(engine, layout.world_size)

    def describe(self, plan: LaunchPlan) -> str:
        return describe(plan)

    def status_details(self, run_dir: Path) -> list[str]:
        """Under ``ft=torchft``: each replica group's step, quorum and recovery."""
        return ft_status_lines(run_dir)

    def launch(self, plan: LaunchPlan) -> RunOutcome:
        if ft_enabled(plan.config):
            return launch_replicas(plan, launch)
        return launch(plan)
