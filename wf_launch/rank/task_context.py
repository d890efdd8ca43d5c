"""What a task receives: the run's config, this rank's place, its groups, a logger."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worldfoundry.core.distributed.env import LaunchEnv, launch_attempt
from worldfoundry.core.distributed.topology import COMBINED, DIMS
from worldfoundry.core.validation import is_int

from ..config.layout import layout_of
from ..rundir.identity import RUN_ID_ENV, read_run_id
from .ft import FtSession, ft_enabled
from .progress import ProgressReporter, publish_interval
from .stop import StopFlag
from .task_registry import task_config_class
from .trackers import open_trackers

if TYPE_CHECKING:
    import torch
    from loguru import Logger

    from worldfoundry.core.distributed.groups import GroupCoordinator
    from worldfoundry.core.distributed.pipeline import PPScheduler

    from ..config.task import TaskConfig
    from .checkpoint import Checkpointer
    from .progress import ProgressReporter
    from .stop import StopFlag

__all__ = ["TaskContext", "build_context", "build_own_group_context"]


@dataclass
class TaskContext:
    """Everything a task needs on one rank.

    ``cfg`` is the task's config, the documented way to read it: an instance of the dataclass the
    task was registered with (``register_task(name, config=...)``), typed, defaults applied.
    ``config`` is the resolved run config (a plain dict: engine, launcher, task); ``task_config``
    its ``task`` section as a plain dict, the untyped view kept for tasks written before config
    classes. ``rank`` / ``world_size`` / ``local_rank`` / ``device`` place this rank; ``coords`` are
    its tp/cp/pp/dp coordinates. ``groups`` maps 'world', 'tp', 'cp', 'pp', 'dp', 'tp-cp', 'dp-cp',
    'tp-pp' to :class:`~worldfoundry.core.distributed.groups.GroupCoordinator` objects; ``pp`` is
    the PP scheduler when pp_size > 1, else None. ``run_dir`` is the run directory shared by all
    ranks; ``log`` a loguru logger bound to this rank. ``run_id`` is the run's stable id
    (``RUN_DIR/run_id``, also ``$WF_RUN_ID``): the same in every attempt, restart, requeue and
    resume of the run, e.g. to name the run in your own tracker.

    ``ft`` is torchft's ``Manager`` under ``ft=torchft`` (None otherwise): the run is
    ``ft.replicas`` replica groups, each its own world of this layout (``rank``, ``world_size``
    and ``groups`` are the replica group's); ``ft_replica`` is this rank's replica group
    (docs/fault-tolerance.md).
    """

    cfg: TaskConfig
    config: dict[str, Any]
    task_config: dict[str, Any]
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    coords: dict[str, int]
    groups: dict[str, GroupCoordinator]
    pp: PPScheduler | None
    run_dir: Path
    log: Logger
    run_id: str = ""
    reporter: ProgressReporter | None = None
    stop: StopFlag | None = None
    _checkpointer: Checkpointer | None = field(default=None, repr=False)
    ft_session: FtSession | None = field(default=None, repr=False)

    @property
    def ft(self) -> Any:
        """torchft's Manager of this rank's replica group under ``ft=torchft``; else None."""
        return self.ft_session.manager if self.ft_session is not None else None

    @property
    def ft_replica(self) -> int:
        """This rank's replica group under ``ft=torchft`` (0 otherwise)."""
        return self.ft_session.replica if self.ft_session is not None else 0

    def ft_finish(self) -> None:
        """Under ``ft=torchft``, after the task's last step: hold this replica group, serving its
        state, until the groups coming back after a failure have healed from it (at most
        ``ft.join_timeout_s``); without ft, nothing. Every rank of the group calls it."""
        if self.ft_session is not None:
            self.ft_session.finish(self.groups["world"])

    def progress(self, step: int, total: int | None = None, **metrics: Any) -> None:
        """Report this rank's step (of ``total``) and metrics: cheap, never a collective.

        The launcher shows the run's progress live (slowest rank, rate, ETA, rank
        0's metrics) and warns about a rank that stops making progress; a call with
        metrics also appends a line to ``RUN_DIR/metrics.jsonl``
        (``python -m wf_launch.plot RUN_DIR`` draws them), until it reaches
        ``launcher.max_metrics_mb``. ``rank``, ``step`` and ``time`` are that file's own
        columns: a metric with one of those names is refused (ValueError).
        """
        if self.reporter is not None:
            self.reporter(step, total, **metrics)

    @property
    def checkpoint(self) -> Checkpointer:
        """This run's :class:`~wf_launch.checkpoint.Checkpointer` (created on first use).

        ``keep``, ``async_save`` and ``seed`` come from the task's config when it has those
        fields (3, False and 0 otherwise); checkpoints live in ``RUN_DIR/checkpoints``.
        A pending asynchronous save is committed when the task returns.
        """
        if self._checkpointer is None:
            # torch and DCP: only a task that checkpoints pays for them
            from .checkpoint import Checkpointer

            seed = getattr(
                self.cfg, "seed", 0
            )  # RNG states re-derived after a layout change start from it
            self._checkpointer = Checkpointer(
                self.run_dir,
                keep=int(getattr(self.cfg, "keep", 3)),
                async_save=bool(getattr(self.cfg, "async_save", False)),
                record_attempt=True,
                seed=seed if is_int(seed) else 0,
            )
        return self._checkpointer

    def should_stop(self) -> bool:
        """Whether the run should stop at this step boundary: the same answer on every rank.

        A preemption warning (SLURM), SIGTERM or a stop request only sets a flag on
        the rank that got it; this call agrees on it with a non-blocking all-reduce
        (every rank must call it at the same step boundaries). On True, save a
        checkpoint and return: on SLURM the job is then requeued and resumes.
        """
        return self.stop.should_stop() if self.stop is not None else False

    @property
    def is_main(self) -> bool:
        """Rank 0: the rank that writes the run's outputs."""
        return self.rank == 0


def _metrics_cap(config: dict[str, Any]) -> int:
    """``launcher.max_metrics_mb`` in bytes (0: no cap)."""
    mb = (config.get("launcher") or {}).get("max_metrics_mb") or 0
    return int(float(mb) * 2**20)


def _attempt() -> int:

    try:
        return launch_attempt()
    except ValueError:
        return 0


def build_context(config: dict[str, Any], run_dir: Path, device: Any, log: Any) -> TaskContext:
    """Assemble the context from the live groups (after ``dist_init``)."""
    # torch: ``import wf_launch`` (TaskContext) stays light for the launcher and the tools
    from worldfoundry.core.distributed import groups as g

    world = g.get_world_group()
    layout = g.get_layout()
    groups = {"world": world, **{n: g.get_group(n) for n in (*DIMS, *COMBINED)}}
    pp = None
    if layout.pp_size > 1:
        # torch, as for the groups above
        from worldfoundry.core.distributed.pipeline import pp_scheduler

        pp = pp_scheduler()

    task = dict(config.get("task", {}))
    run_id, reporter = _reporter(config, run_dir, world.rank, log)
    session = (
        FtSession(config, Path(run_dir), world.rank, world.world_size, world, log)
        if ft_enabled(config)
        else None
    )
    return TaskContext(
        cfg=task_config_class(task["name"]).build(task),
        config=config,
        task_config=task,
        rank=world.rank,
        world_size=world.world_size,
        local_rank=LaunchEnv.from_environ().local_rank,
        device=device,
        coords=layout.coords(world.rank),
        groups=groups,
        pp=pp,
        run_dir=Path(run_dir),
        log=log,
        run_id=run_id,
        reporter=reporter,
        stop=StopFlag(world.cpu_group),
        ft_session=session,
    )


def build_own_group_context(config: dict[str, Any], run_dir: Path, log: Any) -> TaskContext:
    """The context of a task that starts its own process group (``task=script``, ``task=call``).

    No groups, no PP scheduler and no device yet (``groups`` is empty, ``device`` None):
    the task's code starts its group. The stop flag agrees over the default group once
    that code has started one (before that, and without one, each rank answers alone), at
    every call: a stop seen during step ``k`` is agreed after step ``k + 1``. Nothing here
    imports torch.
    """

    env = LaunchEnv.from_environ()
    task = dict(config.get("task", {}))
    run_id, reporter = _reporter(config, run_dir, env.rank, log)
    return TaskContext(
        cfg=task_config_class(task["name"]).build(task),
        config=config,
        task_config=task,
        rank=env.rank,
        world_size=env.world_size,
        local_rank=env.local_rank,
        device=None,
        coords=layout_of(config).coords(env.rank),
        groups={},
        pp=None,
        run_dir=Path(run_dir),
        log=log,
        run_id=run_id,
        reporter=reporter,
        stop=StopFlag(None, every=1),
    )


def _reporter(config: dict[str, Any], run_dir: Path, rank: int, log: Any) -> tuple[str, Any]:
    """The run's id and this rank's progress reporter (``metrics.jsonl`` within
    ``launcher.max_metrics_mb``, the experiment trackers of ``tracking``)."""

    run_id = os.environ.get(RUN_ID_ENV) or read_run_id(run_dir) or ""
    sink = open_trackers(config, run_dir, rank, run_id, _attempt(), log)
    return run_id, ProgressReporter(
        run_dir, rank, publish_interval(), _metrics_cap(config), warn=log.warning, sink=sink
    )
