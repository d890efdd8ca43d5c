"""Submission: a plan's sbatch parameters and script, one job, or a sweep's job arrays
(:class:`SlurmBatch`, one array per distinct sbatch shape)."""

from __future__ import annotations

import contextvars
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from ...config.fields import config_error
from ...rank.entrypoint import RankSpec
from ...rank.ft import ft_enabled
from ...rundir import attempts
from ...rundir.claim import make_private
from ...rundir.environment import record_environment
from ...rundir.io import atomic_write_json
from ...rundir.outcome import RunOutcome
from ...rundir.record import RecordError, RunRecord, Status
from ..ft_replicas import describe_ft
from ..interrupt import say
from ..launch_plan import LaunchPlan
from ..snapshot import SnapshotError, code_dir, job_setup, project_root, take_for
from .ft import SlurmFtSupervisor
from .poll import JOB_FILE
from .rank_entry import SlurmRank, SlurmRequeue, SlurmStackDump
from .submitit_adapter import convert_mem, make_sbatch_string, slurm_executor, submit_command
from .wait import wait_all


def slurm_tasks_per_node(launcher: Any, world_size: int) -> int:
    """``launcher.tasks_per_node``, or world size / nodes when it is null."""
    nodes = launcher.nodes
    if launcher.tasks_per_node is not None:
        return int(launcher.tasks_per_node)
    if world_size % nodes:
        raise config_error(
            "launcher.nodes",
            nodes,
            f"the layout's {world_size} rank(s) must split evenly over "
            "the nodes (or set launcher.tasks_per_node)",
        )
    return world_size // nodes


def _tasks_per_node(plan: LaunchPlan) -> int:
    """One per rank (``launcher.tasks_per_node``, or world size / nodes); one under ft (the
    replica groups are job steps of their own)."""
    if ft_enabled(plan.config):
        return 1
    return slurm_tasks_per_node(plan.launcher_config, plan.world_size)


def submitit_folder(plan: LaunchPlan, shared: Path | None = None) -> Path:
    """submitit's folder: in the run directory, or ``shared`` (a sweep's job arrays)."""
    return ((shared or plan.run_dir) / plan.launcher_config.folder).absolute()


def sbatch_parameters(plan: LaunchPlan, shared: Path | None = None) -> dict[str, Any]:
    """The submitit SlurmExecutor parameters (sbatch names) for this plan."""
    lc = plan.launcher_config
    extra = {k: True if v == "" else v for k, v in dict(lc.sbatch_extra or {}).items()}
    ft_groups = 0  # under ft: the replica groups on the busiest node
    flags: dict[str, Any] = {"requeue": True}
    if ft_enabled(plan.config):
        ft_groups = -(-int(plan.config["ft"]["replicas"]) // int(lc.nodes))
        flags["no_kill"] = True  # a lost node ends its groups' steps, not the allocation
    params: dict[str, Any] = {
        "job_name": lc.job_name,
        "nodes": lc.nodes,
        "ntasks_per_node": _tasks_per_node(plan),
        # under ft one task per node (the first supervises): the CPUs of its node's groups
        "cpus_per_task": lc.cpus_per_task * plan.world_size * ft_groups or lc.cpus_per_task,
        "time": lc.time_min,
        "signal_delay_s": lc.signal_delay_s,
        "srun_args": ["--kill-on-bad-exit=1", *lc.srun_args],
        "additional_parameters": {**flags, **extra},  # '': a bare flag (--exclusive)
    }
    if lc.mem_gb is not None:
        params["mem"] = convert_mem(float(lc.mem_gb))
    for key in ("gpus_per_node", "partition", "account", "qos", "constraint", "exclude"):
        if getattr(lc, key):
            params[key] = getattr(lc, key)
    code, root = code_dir(lc, shared or plan.run_dir), project_root()
    setup = [*(job_setup(code, root) if code is not None and root is not None else []), *lc.setup]
    if setup:
        params["setup"] = setup
    return params


def sbatch_script(plan: LaunchPlan, shared: Path | None = None, array: int | None = None) -> str:
    """The exact sbatch script submitit submits for this plan (``array``: the job array's size)."""
    folder, params = submitit_folder(plan, shared), sbatch_parameters(plan, shared)
    return make_sbatch_string(
        command=submit_command(folder), folder=folder, map_count=array, **params
    )


def describe(plan: LaunchPlan) -> str:
    """The submission as text, then the sbatch script (``launcher.dry_run``)."""
    lc = plan.launcher_config
    code = code_dir(lc, plan.run_dir)
    if ft_enabled(plan.config):
        tasks = f"{lc.nodes} node(s) x 1 task (the first supervises the replica groups)"
    else:
        tpn = slurm_tasks_per_node(lc, plan.world_size)
        tasks = f"{lc.nodes} node(s) x {tpn} task(s) = {plan.world_size} rank(s)"
    return "\n".join(
        [
            f"launcher      slurm (submitit), {tasks}",
            f"task          {plan.task}",
            f"time limit    {lc.time_min} min; USR2 {lc.signal_delay_s} s before it "
            f"(on_preempt hooks, up to {lc.max_requeues} requeue(s))",
            f"wait          {lc.wait}",
            f"run dir       {plan.run_dir}",
            f"submitit      {submitit_folder(plan)}",
            f"code          {code or 'the checkout / installed package (no snapshot)'}",
            *describe_ft(
                plan,
                "a job step of one job (its first task supervises them)",
                "the first node's address",
            ),
            "",
            "sbatch script:",
            sbatch_script(plan),
        ]
    )


def _executor(
    plan: LaunchPlan, shared: Path | None = None, requeues: int | None = None, **params: Any
) -> Any:
    """submitit's executor, its folder owner-only first (submitit runs the pickles there);
    ``params`` replace sbatch parameters of the plan's."""
    folder = submitit_folder(plan, shared)
    make_private(folder)
    lc = plan.launcher_config
    requeues = lc.max_requeues if requeues is None else requeues
    return slurm_executor(folder, requeues, **{**sbatch_parameters(plan, shared), **params})


def _snapshot(plan: LaunchPlan) -> tuple[Any, RunOutcome | None]:
    """The run's code snapshot (``launcher.snapshot``), or the outcome of a refused one."""
    try:
        return take_for(plan.launcher_config, plan.run_dir), None
    except SnapshotError as exc:
        _refused(plan, exc)
        record = RunRecord.read(plan.run_dir)
        return None, RunOutcome.of(record, plan.run_dir, "")  # type: ignore[arg-type]


def _plan_info(plan: LaunchPlan) -> dict[str, Any]:
    return {**plan.run_info(), "environment": record_environment(plan.run_dir)}


def _refused(plan: LaunchPlan, exc: Exception) -> str:
    """Record a run whose submission was refused: a snapshot that cannot be taken (exit 2), or
    sbatch refusing it (exit 1); the message, also printed."""
    kind = type(exc).__name__
    failure = {"cause": "launcher_error", "type": kind, "message": str(exc)}
    message = f"sbatch refused the job array: {kind}: {exc}"
    if isinstance(exc, SnapshotError):
        failure.update(cause="invalid_config", type="SnapshotError")
        message = str(exc)
    say(f"{plan.run_dir}: {message}")
    status = Status.INVALID if isinstance(exc, SnapshotError) else Status.FAILED
    RunRecord.finalize(plan.run_dir, status, **_plan_info(plan), failure=failure)
    return message


def _record_job(
    plan: LaunchPlan, job_id: str, folder: Path, at: float, snapshot: Any, **extra: Any
) -> None:
    """The run's ``slurm_job.json``: its job, and what the final record will hold."""
    lc = plan.launcher_config
    record = {
        "job_id": job_id,
        "folder": str(folder),
        "submitted_at": at,
        "snapshot": snapshot,
        "nodes": lc.nodes,
        "tasks_per_node": _tasks_per_node(plan),
        "world_size": plan.world_size,
        "info": _plan_info(plan),
        "status_command": f"python -m wf_launch.status {plan.run_dir}",
        **extra,
    }
    atomic_write_json(plan.run_dir / JOB_FILE, record)


@dataclass
class Pending:
    """A prepared, not yet submitted run (a sweep point waiting in a :class:`SlurmBatch`)."""

    plan: LaunchPlan
    fn: SlurmRank


_CURRENT: contextvars.ContextVar[SlurmBatch | None] = contextvars.ContextVar(
    "wf_launch_slurm_batch", default=None
)


def current_batch() -> SlurmBatch | None:
    """The batch :func:`launch` prepares into now (None: submit each run at once)."""
    return _CURRENT.get()


class SlurmBatch:
    """SLURM runs prepared during a sweep, submitted together (one job array per sbatch shape,
    its submitit folder in the sweep directory ``shared``)."""

    def __init__(self, shared: Path) -> None:
        self.shared = Path(shared).absolute()
        self.pending: list[Pending] = []

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, pending: Pending) -> None:
        self.pending.append(pending)

    @contextmanager
    def collecting(self) -> Iterator[SlurmBatch]:
        """While open, :func:`launch` prepares runs into this batch; an exception drops them."""
        token = _CURRENT.set(self)
        try:
            yield self
        except BaseException:
            self.pending.clear()
            raise
        finally:
            _CURRENT.reset(token)

    def submit(self) -> list[tuple[Pending, str | None, str]]:
        """Submit every prepared run, one job array per sbatch shape; (run, job id or None,
        error) each (a refused run is recorded)."""
        runs, self.pending = self.pending, []
        snapshots = (
            take_for(r.plan.launcher_config, self.shared)
            for r in runs
            if r.plan.launcher_config.snapshot
        )
        try:
            snapshot = next(snapshots, None)
        except SnapshotError as exc:
            return [(run, None, _refused(run.plan, exc)) for run in runs]
        groups: dict[str, list[Pending]] = {}
        for run in runs:
            shape = [sbatch_parameters(run.plan, self.shared), run.plan.launcher_config.folder]
            groups.setdefault(json.dumps(shape, sort_keys=True), []).append(run)
        return [out for group in groups.values() for out in self._submit_array(group, snapshot)]

    def _submit_array(
        self, group: list[Pending], snapshot: dict[str, Any] | None
    ) -> list[tuple[Pending, str | None, str]]:
        ex = _executor(group[0].plan, self.shared)
        submitted_at = time.time()
        try:
            with ex.batch():
                jobs = [ex.submit(run.fn) for run in group]
        except Exception as exc:
            return [(run, None, _refused(run.plan, exc)) for run in group]
        for run, job in zip(group, jobs):
            kept = snapshot if run.plan.launcher_config.snapshot else None
            _record_job(run.plan, job.job_id, ex.folder, submitted_at, kept)
        logger.info(f"submitted {len(group)} point(s) as job array {jobs[0].job_id.split('_')[0]}")
        return [(run, job.job_id, "") for run, job in zip(group, jobs)]

    def submit_and_wait(self) -> dict[Path, RunOutcome]:
        """Submit, then wait for every run with ``launcher.wait=true``; each one's new outcome
        (runs with ``wait=false`` keep their 'submitted' one)."""
        submitted = self.submit()
        outcomes = {
            p.plan.run_dir: _not_submitted(p.plan.run_dir, e) for p, j, e in submitted if not j
        }
        waiting = [p.plan.run_dir for p, j, _ in submitted if j and p.plan.launcher_config.wait]
        if waiting:
            poll = min(p.plan.launcher_config.poll_interval_s for p, _, _ in submitted)
            print(f"wf_launch: waiting for {len(waiting)} SLURM job(s)", flush=True)
            for outcome in wait_all(waiting, poll):
                outcomes[Path(outcome.run_dir)] = outcome
        return outcomes


def _not_submitted(run_dir: Path, why: str) -> RunOutcome:
    """A prepared run never submitted: its recorded status (invalid, failed), with why."""
    try:
        record = RunRecord.read(run_dir)
    except RecordError:
        record = None
    return RunOutcome(record.status if record is not None else Status.FAILED, run_dir, why)


def launch_ft(plan: LaunchPlan) -> RunOutcome:
    """``ft=torchft``: one job holding every replica group, its first task their supervisor
    (:mod:`.ft`); wait for it."""
    lc = plan.launcher_config
    if current_batch() is not None:
        message = str(
            config_error(
                "ft",
                "torchft",
                "one run at a time on launcher=slurm (its replica groups are job steps of one "
                "job): no -m sweep; or launcher=local",
            )
        )
        say(f"config error: {message}")
        failure = {"cause": "invalid_config", "message": message}
        record = RunRecord.finalize(
            plan.run_dir, Status.INVALID, **_plan_info(plan), failure=failure
        )
        return RunOutcome.of(record, plan.run_dir, "")
    replicas = int(plan.config["ft"]["replicas"])
    snapshot, refused = _snapshot(plan)
    if refused is not None:
        return refused
    ex = _executor(plan)  # the supervisor requeues the job after the preemption warning (.ft)
    launch_time = time.time()
    job = ex.submit(SlurmFtSupervisor(plan))
    _record_job(plan, job.job_id, ex.folder, launch_time, snapshot, ft_replicas=replicas)
    logger.info(
        f"submitted SLURM job {job.job_id}: {replicas} replica group(s) of {plan.world_size} "
        f"rank(s), one job step each, task={plan.task}, run dir {plan.run_dir}"
    )
    return wait_all([plan.run_dir], lc.poll_interval_s)[0]


def launch(plan: LaunchPlan) -> RunOutcome:
    """Submit the run (or prepare it into the current batch); wait for it unless told not to."""
    lc = plan.launcher_config
    if ft_enabled(plan.config):
        return launch_ft(plan)
    launch_time = time.time()
    fn = SlurmRank(
        RankSpec(
            config=plan.config,
            run_dir=str(plan.run_dir.absolute()),
            threads_per_rank=lc.cpus_per_task,
            console_ranks=lc.console_ranks,
            launch_time=launch_time,
            max_log_mb=float(lc.max_log_mb or 0),
            on_timeout=SlurmStackDump(),
            attempt_base=attempts.count(plan.run_dir),
            preempt=SlurmRequeue(
                os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"),
                float(lc.preempt_wait_s),
                lc.max_requeues,
            ),
        )
    )
    batch = current_batch()
    if batch is not None:
        batch.add(Pending(plan, fn))
        return RunOutcome(Status.SUBMITTED, plan.run_dir)
    snapshot, refused = _snapshot(plan)
    if refused is not None:
        return refused
    ex = _executor(plan)
    job = ex.submit(fn)
    _record_job(plan, job.job_id, ex.folder, launch_time, snapshot)
    logger.info(
        f"submitted SLURM job {job.job_id}: {plan.world_size} rank(s), task={plan.task}, "
        f"run dir {plan.run_dir}"
    )
    if not lc.wait:
        status = f"status: python -m wf_launch.status {plan.run_dir}"
        return RunOutcome(
            Status.SUBMITTED, plan.run_dir, f"submitted SLURM job {job.job_id}; {status}"
        )
    return wait_all([plan.run_dir], lc.poll_interval_s)[0]
