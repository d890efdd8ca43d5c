"""SLURM ranks through submitit: one SLURM task per rank, each entering ``rank_main`` (docs/slurm.md).

The launcher renders the sbatch script with submitit (``launcher.dry_run`` prints it),
submits one job (or, for a ``-m`` sweep through the ``wf_slurm`` Hydra launcher, every
point at once as job arrays, see :class:`SlurmBatch`), records ``slurm_job.json`` in
the run directory, and either returns (``launcher.wait=false``) or polls ``sacct``
until the job ends and finalizes ``result.json``.

By role: :mod:`.env` (inside a SLURM task), :mod:`.submit` (sbatch parameters, one
job, a sweep's batch), :mod:`.poll` (job and queue state, waiting with the live view, cancel), :mod:`.finalize`
(``result.json`` of an ended job, each rank's outcome), :mod:`.submitit_adapter`
(every submitit name we use). This module holds the config and the launcher class.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ...config import NCCL_BACKENDS, config_error, normalize_backend, positive_int
from ...outcome import RunOutcome
from ...plan import LaunchPlan
from ...record import RunRecord
from ..base import LauncherConfig
from ..registry import register_launcher
from .env import SlurmRank, SlurmRequeue, export_rank_env, master_port
from .finalize import JOB_FILE, finalize, rank_outcomes, read_job
from .poll import TERMINAL_STATES, cancel, in_queue, is_terminal, job_state, live_state, wait_all, wait_gone
from .submit import (
    Pending,
    SlurmBatch,
    current_batch,
    describe,
    launch,
    sbatch_parameters,
    sbatch_script,
    slurm_tasks_per_node,
    submitit_folder,
)

if TYPE_CHECKING:
    from worldfoundry.core.distributed.topology import Layout

__all__ = ["JOB_FILE", "TERMINAL_STATES", "Pending", "SlurmBatch", "SlurmLauncher", "SlurmLauncherConfig",
           "SlurmRank", "SlurmRequeue", "cancel", "current_batch", "describe", "export_rank_env", "finalize",
           "in_queue", "is_terminal", "job_state", "launch", "master_port", "rank_outcomes", "read_job",
           "sbatch_parameters", "sbatch_script", "slurm_tasks_per_node", "submitit_folder",
           "validate_slurm_launcher", "wait_all", "wait_gone"]


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
    snapshot: bool = True


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SBATCH_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
OWNED_SRUN_OPTIONS = ("--ntasks", "-n", "--nodes", "-N", "--ntasks-per-node", "--kill-on-bad-exit", "-K",
                      "--cpus-per-task", "-c", "--gpus-per-node", "--gres", "--output", "-o", "--error", "-e",
                      "--unbuffered", "-u", "--jobid", "--het-group", "--pack-group")
"""srun options the launcher sets itself: the layout (one task per rank) and "one failing rank ends the step"."""
MAX_POLL_S = 600.0
MAX_MEM_GB = 1 << 20


def _single_line(field: str, value: Any, what: str) -> None:
    if isinstance(value, str) and _CONTROL.search(value):
        raise config_error(field, value, f"{what} without control characters (a newline would end the "
                           "#SBATCH block and run the rest as shell)")


def validate_slurm_launcher(launcher: dict[str, Any], engine: dict[str, Any], world_size: int) -> None:
    """SLURM launcher values, and that one SLURM task per rank covers the layout exactly.

    Every value that reaches the sbatch script is a single line: a newline in a
    partition or an ``sbatch_extra`` value would end the ``#SBATCH`` block, run
    what follows as shell, and silently drop every later ``#SBATCH`` line.
    """
    positive_int("launcher.nodes", launcher.get("nodes"))
    if launcher.get("tasks_per_node") is not None:
        positive_int("launcher.tasks_per_node", launcher["tasks_per_node"])
    for key in ("cpus_per_task", "time_min", "signal_delay_s"):
        positive_int(f"launcher.{key}", launcher.get(key))
    for key in ("gpus_per_node", "max_requeues"):
        value = launcher.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise config_error(f"launcher.{key}", value, "expected an integer >= 0")
    mem = launcher.get("mem_gb")
    if mem is not None and not (isinstance(mem, (int, float)) and 0 < mem <= MAX_MEM_GB):
        raise config_error("launcher.mem_gb", mem, f"expected GB in (0, {MAX_MEM_GB}], or null for the "
                           "partition's default")
    for key in ("poll_interval_s", "preempt_wait_s"):
        value = launcher.get(key, 0)
        if not (isinstance(value, (int, float)) and 0 < value <= MAX_POLL_S):
            raise config_error(f"launcher.{key}", value, f"expected seconds in (0, {MAX_POLL_S:g}]")
    if launcher["signal_delay_s"] >= launcher["time_min"] * 60:
        raise config_error("launcher.signal_delay_s", launcher["signal_delay_s"],
                           f"expected fewer seconds than the time limit ({launcher['time_min'] * 60} s)")
    if not isinstance(launcher.get("snapshot", True), bool):
        raise config_error("launcher.snapshot", launcher.get("snapshot"), "expected true or false")
    for key in ("partition", "account", "qos", "constraint", "exclude", "job_name"):
        _single_line(f"launcher.{key}", launcher.get(key), "a single line")
    for key, value in dict(launcher.get("sbatch_extra") or {}).items():
        if not isinstance(key, str) or not _SBATCH_KEY.fullmatch(key):
            raise config_error("launcher.sbatch_extra", {key: value}, "keys are sbatch option names "
                               "(letters, digits, '-' and '_', e.g. mail-type)")
        _single_line(f"launcher.sbatch_extra.{key}", value if isinstance(value, str) else str(value), "a single line")
    for i, line in enumerate(launcher.get("setup") or []):
        _single_line(f"launcher.setup[{i}]", line, "one shell line per list item")
    for i, arg in enumerate(launcher.get("srun_args") or []):
        _single_line(f"launcher.srun_args[{i}]", arg, "one argument")
        option = str(arg).split("=", 1)[0]
        if option in OWNED_SRUN_OPTIONS or (option.startswith("-") and not option.startswith("--")
                                            and option[:2] in OWNED_SRUN_OPTIONS):
            raise config_error(f"launcher.srun_args[{i}]", arg,
                               f"{option} is set by the launcher (one task per rank, --kill-on-bad-exit=1); "
                               "use launcher.nodes / launcher.tasks_per_node / launcher.cpus_per_task instead")
    _validate_folder(launcher.get("folder"))
    tpn = slurm_tasks_per_node(launcher, world_size)
    if launcher["nodes"] * tpn != world_size:
        raise config_error("launcher.tasks_per_node", launcher.get("tasks_per_node"),
                           f"launcher.nodes ({launcher['nodes']}) x launcher.tasks_per_node ({tpn}) = "
                           f"{launcher['nodes'] * tpn} SLURM tasks, but the layout "
                           f"(tp*cp*pp*dp) has {world_size} rank(s); one task per rank")
    if normalize_backend(engine.get("distributed_backend", "auto")) in NCCL_BACKENDS and launcher["gpus_per_node"] < tpn:
        raise config_error("launcher.gpus_per_node", launcher["gpus_per_node"],
                           f"engine.distributed_backend={engine.get('distributed_backend')!r} needs one GPU per "
                           f"task: at least launcher.tasks_per_node ({tpn}); or use gloo")


def _validate_folder(folder: Any) -> None:
    """submitit's folder is a relative path inside the run (or sweep) directory: submitit runs the pickles there."""
    text = str(folder or "")
    parts = Path(text).parts
    if (not text.strip() or _CONTROL.search(text) or Path(text).is_absolute() or ".." in parts
            or text.startswith("~")):
        raise config_error("launcher.folder", folder, "a relative folder inside the run directory (no '..', "
                           "not absolute): submitit executes the pickles it finds there")


@register_launcher
class SlurmLauncher:
    """One SLURM task per rank through submitit (``launcher=slurm``); a detached launcher."""

    name: ClassVar[str] = "slurm"
    config_class: ClassVar[type[LauncherConfig]] = SlurmLauncherConfig

    def validate(self, cfg: dict[str, Any], layout: Layout, engine: dict[str, Any]) -> None:
        validate_slurm_launcher(cfg, engine, layout.world_size)

    def describe(self, plan: LaunchPlan) -> str:
        return describe(plan)

    def launch(self, plan: LaunchPlan) -> RunOutcome:
        return launch(plan)

    def status(self, run_dir: Path) -> tuple[str, RunOutcome | None]:
        """sacct's state of the run's job, and its final outcome once SLURM has cleaned it up."""
        job = read_job(run_dir)
        if not job:  # not submitted (yet): a refused submission has a final record
            record = RunRecord.read(run_dir)
            if record is not None and record.final:
                return "NOT SUBMITTED", RunOutcome.of(record, Path(run_dir))
            return "NOT SUBMITTED", None
        state = job_state(job["job_id"], Path(run_dir))
        if is_terminal(state) and not in_queue(job["job_id"]):
            return state, finalize(run_dir, state)
        return state, None

    def cancel(self, run_dir: Path) -> str | None:
        return cancel(run_dir)

    # python -m wf_launch.status: what it shows of a SLURM run beyond the generic lines.
    def signal_ranks(self, run_dir: Path) -> bool:
        """Ask every rank of the run's job to dump its stacks (``scancel --signal=URG``, steps only)."""
        import subprocess

        from ...stacks import DUMP_SIGNAL

        job = read_job(run_dir)
        if not job or is_terminal(job_state(job["job_id"], Path(run_dir))):
            return False
        out = subprocess.run(["scancel", f"--signal={DUMP_SIGNAL.name.removeprefix('SIG')}", job["job_id"]],
                             capture_output=True, text=True, timeout=30, check=False)
        return out.returncode == 0

    def live_state(self, run_dir: Path) -> tuple[str, str] | None:
        """('SLURM job 42', 'RUNNING on n[1-2]') for the live view (``status --follow``); None once it left the queue."""
        return live_state(run_dir)

    def status_label(self, run_dir: Path) -> str:
        return f"SLURM job {(read_job(run_dir) or {}).get('job_id')}"

    def status_details(self, run_dir: Path) -> list[str]:
        return [f"rank {rank}: {text}" for rank, text in rank_outcomes(run_dir).items()]


