"""SLURM ranks through submitit: one SLURM task per rank, each entering ``rank_main``
(docs/slurm.md). By role: :mod:`.rank_entry` (inside a task), :mod:`.submit` (sbatch, jobs,
job arrays), :mod:`.poll` (the job's state, signals, cancel, its ``result.json``), :mod:`.wait`
(waiting, and stopping on Ctrl-C / SIGTERM), :mod:`.failure` (why a job failed),
:mod:`.submitit_adapter` (every submitit name we use).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ...config.engine import NCCL_BACKENDS
from ...config.fields import (
    check_fields,
    check_single_line,
    config_error,
    flag,
    integer,
    line,
    number,
)
from ...rundir.claim import launch_alive
from ...rundir.outcome import RunOutcome
from ...rundir.record import RunRecord
from ..base import LauncherConfig, LauncherHooks
from ..ft_record import ft_status_lines
from ..registry import register_launcher
from . import poll
from .poll import finalize, rank_outcomes, read_job
from .submit import SlurmBatch, current_batch, describe, launch, slurm_tasks_per_node

if TYPE_CHECKING:
    from worldfoundry.core.distributed.topology import Layout

    from ...config.engine import EngineConfig

__all__ = [
    "SlurmBatch",
    "SlurmLauncher",
    "SlurmLauncherConfig",
    "current_batch",
    "validate_slurm_launcher",
]


MAX_POLL_S = 600.0
MAX_MEM_GB = 1 << 20
_NEWLINE = "a newline would end the #SBATCH block and run the rest as shell"
_MEM_NOTE = "per node, or null for the partition's default"
_SNAPSHOT_NOTE = "the largest code snapshot a submission copies"


@dataclass
class SlurmLauncherConfig(LauncherConfig):
    """One SLURM task per rank, submitted through submitit (docs/slurm.md)."""

    name: str = "slurm"
    nodes: int = integer(1, low=1)
    tasks_per_node: int | None = integer(None, low=1, optional=True)
    gpus_per_node: int = integer(0, low=0)
    cpus_per_task: int = integer(1, low=1)
    mem_gb: float | None = number(
        None, 0, MAX_MEM_GB, low_open=True, unit="GB", note=_MEM_NOTE, optional=True
    )
    partition: str | None = line(None, why=_NEWLINE)
    account: str | None = line(None, why=_NEWLINE)
    qos: str | None = line(None, why=_NEWLINE)
    time_min: int = integer(60, low=1)
    constraint: str | None = line(None, why=_NEWLINE)
    exclude: str | None = line(None, why=_NEWLINE)
    job_name: str = line("wf_launch", why=_NEWLINE)
    sbatch_extra: dict[str, str] = field(default_factory=dict)
    setup: list[str] = field(default_factory=list)
    srun_args: list[str] = field(default_factory=list)
    folder: str = "submitit"
    wait: bool = flag(True)
    poll_interval_s: float = number(1.0, 0, MAX_POLL_S, low_open=True, unit="seconds")
    signal_delay_s: int = integer(90, low=1)
    max_requeues: int = integer(3, low=0)
    preempt_wait_s: float = number(20.0, 0, MAX_POLL_S, low_open=True, unit="seconds")
    snapshot: bool = flag(True)
    snapshot_untracked: bool = flag(False)
    snapshot_max_mb: float = number(
        256.0, 0, MAX_MEM_GB * 1024, low_open=True, unit="MB", note=_SNAPSHOT_NOTE
    )


_SBATCH_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
_OWNED = "--ntasks -n --nodes -N --ntasks-per-node --kill-on-bad-exit -K --cpus-per-task -c "
OWNED_SRUN_OPTIONS = tuple(
    (
        _OWNED
        + "--gpus-per-node --gres --output -o --error -e --unbuffered -u --jobid --het-group "
        "--pack-group"
    ).split()
)
"""srun options the launcher sets itself: the layout (one task per rank) and "one failing rank
ends the step"."""


def validate_slurm_launcher(
    lc: SlurmLauncherConfig, engine: EngineConfig, world_size: int, ft: bool = False
) -> None:
    """SLURM launcher values (each a single line: a newline would end the ``#SBATCH`` block),
    and that one SLURM task per rank covers the layout exactly (``ft``: one task per node)."""
    check_fields(lc, "launcher")
    if lc.signal_delay_s >= lc.time_min * 60:
        raise config_error(
            "launcher.signal_delay_s",
            lc.signal_delay_s,
            f"expected fewer seconds than the time limit ({lc.time_min * 60} s)",
        )
    _validate_script_lines(lc)
    _validate_folder(lc.folder)
    if ft:  # one task per node, the replica groups job steps of their own
        if lc.tasks_per_node is not None:
            raise config_error(
                "launcher.tasks_per_node",
                lc.tasks_per_node,
                "null under ft=torchft: each replica group is a job step on one node",
            )
        return
    tpn = slurm_tasks_per_node(lc, world_size)
    if lc.nodes * tpn != world_size:
        raise config_error(
            "launcher.tasks_per_node",
            lc.tasks_per_node,
            f"launcher.nodes ({lc.nodes}) x launcher.tasks_per_node ({tpn}) = "
            f"{lc.nodes * tpn} SLURM tasks, but the layout (tp*cp*pp*dp) has {world_size} "
            "rank(s); one task per rank",
        )
    if engine.backend in NCCL_BACKENDS and lc.gpus_per_node < tpn:
        raise config_error(
            "launcher.gpus_per_node",
            lc.gpus_per_node,
            f"engine.distributed_backend={engine.distributed_backend!r} needs one GPU per "
            f"task: at least launcher.tasks_per_node ({tpn}); or use gloo",
        )


def _validate_script_lines(lc: SlurmLauncherConfig) -> None:
    """``sbatch_extra``, ``setup``, ``srun_args``: single lines, no srun option we set ourselves."""
    for key, value in dict(lc.sbatch_extra or {}).items():
        if not isinstance(key, str) or not _SBATCH_KEY.fullmatch(key):
            raise config_error(
                "launcher.sbatch_extra",
                {key: value},
                "keys are sbatch option names (letters, digits, '-' and '_', e.g. mail-type)",
            )
        check_single_line(f"launcher.sbatch_extra.{key}", str(value), why=_NEWLINE)
    for i, text in enumerate(lc.setup or []):
        what = "one shell line per list item"
        check_single_line(f"launcher.setup[{i}]", text, what, why=_NEWLINE)
    for i, arg in enumerate(lc.srun_args or []):
        check_single_line(f"launcher.srun_args[{i}]", arg, "one argument", why=_NEWLINE)
        option = str(arg).split("=", 1)[0]
        short = option[:2] if option.startswith("-") and not option.startswith("--") else ""
        if option in OWNED_SRUN_OPTIONS or short in OWNED_SRUN_OPTIONS:
            raise config_error(
                f"launcher.srun_args[{i}]",
                arg,
                f"{option} is set by the launcher (one task per rank, --kill-on-bad-exit=1); "
                "use launcher.nodes / launcher.tasks_per_node / launcher.cpus_per_task instead",
            )


def _validate_folder(folder: Any) -> None:
    """submitit's folder (it runs the pickles there): a relative path inside the run dir."""
    text, path = str(folder or ""), Path(str(folder or ""))
    control = any(ord(ch) < 32 or ord(ch) == 127 for ch in text)
    if control or not text.strip() or path.is_absolute() or ".." in path.parts or text[:1] == "~":
        raise config_error(
            "launcher.folder",
            folder,
            "a relative folder inside the run directory (no '..', "
            "not absolute): submitit executes the pickles it finds there",
        )


@register_launcher
class SlurmLauncher(LauncherHooks):
    """One SLURM task per rank through submitit (``launcher=slurm``); a detached launcher."""

    name: ClassVar[str] = "slurm"
    config_class: ClassVar[type[LauncherConfig]] = SlurmLauncherConfig
    drill_kinds: ClassVar[tuple[str, ...]] = ("usr2",)
    supports_ft: ClassVar[bool] = True

    def validate(self, cfg: SlurmLauncherConfig, layout: Layout, engine: EngineConfig) -> None:
        validate_slurm_launcher(cfg, engine, layout.world_size)

    def validate_ft(self, cfg: SlurmLauncherConfig, layout: Layout, engine: EngineConfig) -> None:
        """Under ``ft=torchft``: one task per node, not one per rank."""
        validate_slurm_launcher(cfg, engine, layout.world_size, ft=True)

    describe = staticmethod(describe)
    launch = staticmethod(launch)

    def status(self, run_dir: Path) -> tuple[str, RunOutcome | None]:
        """sacct's state of the run's job, and its final outcome once SLURM has cleaned it up."""
        job = read_job(run_dir)
        if not job:  # not submitted (yet): a refused submission has a final record
            record = RunRecord.read(run_dir)
            if record is not None and record.final:
                return "NOT SUBMITTED", RunOutcome.of(record, Path(run_dir))
            return "NOT SUBMITTED", None
        state = poll.job_state(job["job_id"], Path(run_dir))
        if poll.is_terminal(state) and not poll.in_queue(job["job_id"]):
            return state, finalize(run_dir, state)
        return state, None

    cancel = staticmethod(poll.cancel)
    live_state = staticmethod(poll.live_state)

    signal_ranks = staticmethod(poll.signal_ranks)

    def is_live(self, run_dir: Path) -> bool:
        """Whether its launch holds the run dir or squeue lists its job (sacct can say RUNNING
        for seconds after a cancel). ValueError for a malformed job file."""
        if launch_alive(run_dir):
            return True
        job = read_job(run_dir)
        return bool(job) and poll.in_queue(job["job_id"])

    def status_label(self, run_dir: Path) -> str:
        return f"SLURM job {(read_job(run_dir) or {}).get('job_id')}"

    def status_details(self, run_dir: Path) -> list[str]:
        """Each rank's outcome; under ``ft=torchft`` each replica group's step and quorum."""
        if (read_job(run_dir) or {}).get("ft_replicas"):
            return ft_status_lines(Path(run_dir))
        return [f"rank {rank}: {text}" for rank, text in rank_outcomes(run_dir).items()]

    def run_label(self, run_dir: Path, record: RunRecord | None) -> str:
        """'slurm 42': the launcher with its job id, from the record or ``slurm_job.json``."""
        slurm = record.extra.get("slurm") if record is not None else None
        job = slurm.get("job_id") if isinstance(slurm, dict) else None
        with contextlib.suppress(ValueError):  # a malformed job file: the launcher's name alone
            job = job or (read_job(run_dir) or {}).get("job_id")
        return f"{self.name} {job}" if job else self.name
