"""SLURM ranks through submitit: one SLURM task per rank, each entering ``rank_main``.

The launcher renders the sbatch script with submitit (``launcher.dry_run`` prints it),
submits one job (or, for a ``-m`` sweep through the ``wf_slurm`` Hydra launcher, every
point at once as job arrays), records ``slurm_job.json`` in the run directory, and
either returns (``launcher.wait=false``) or polls ``sacct`` until the job ends and
finalizes ``result.json``. :func:`finalize` is shared with ``python -m wf_launch.status``.

Preemption: sbatch's ``--signal=USR2@signal_delay_s`` reaches every task of the srun
step, and the entrypoint's handler (``RankSpec.preempt`` = :class:`SlurmRequeue`) runs
the task's ``on_preempt(ctx)`` hook on every rank before rank 0 requeues the job.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from loguru import logger

from .. import rundir
from ..config import NCCL_BACKENDS, config_error, normalize_backend, positive_int
from ..entrypoint import ATTEMPT_VAR, Preempted, RankSpec, layout_of, preempt_marker, rank_main
from ..outcome import RunOutcome
from ..plan import LaunchPlan
from ..ranklog import rank_label
from ..record import RunRecord, Status
from ..report import explain_failure, load_failure_records
from .base import LauncherConfig
from .registry import register_launcher

if TYPE_CHECKING:
    from worldfoundry.core.distributed.topology import Layout

JOB_FILE = "slurm_job.json"
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
                             "PREEMPTED", "BOOT_FAIL", "DEADLINE"})
_PORT_RANGE = (20000, 32000)  # below Linux's ephemeral range


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


def slurm_tasks_per_node(launcher: dict[str, Any], world_size: int) -> int:
    """``launcher.tasks_per_node``, or world size / nodes when it is null."""
    nodes = launcher["nodes"]
    if launcher.get("tasks_per_node") is not None:
        return int(launcher["tasks_per_node"])
    if world_size % nodes:
        raise config_error("launcher.nodes", nodes, f"the layout's {world_size} rank(s) must split evenly over "
                           "the nodes (or set launcher.tasks_per_node)")
    return world_size // nodes


def validate_slurm_launcher(launcher: dict[str, Any], engine: dict[str, Any], world_size: int) -> None:
    """SLURM launcher values, and that one SLURM task per rank covers the layout exactly."""
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
    if mem is not None and not mem > 0:
        raise config_error("launcher.mem_gb", mem, "expected GB > 0, or null for the partition's default")
    for key in ("poll_interval_s", "preempt_wait_s"):
        if not launcher.get(key, 0) > 0:
            raise config_error(f"launcher.{key}", launcher.get(key), "expected seconds > 0")
    if launcher["signal_delay_s"] >= launcher["time_min"] * 60:
        raise config_error("launcher.signal_delay_s", launcher["signal_delay_s"],
                           f"expected fewer seconds than the time limit ({launcher['time_min'] * 60} s)")
    if not str(launcher.get("folder") or "").strip():
        raise config_error("launcher.folder", launcher.get("folder"), "a folder name inside the run directory")
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


# ----------------------------------------------------------------------------- in the SLURM task
@dataclass(frozen=True)
class SlurmRequeue:
    """The entrypoint's preemption policy on SLURM (see ``entrypoint._install_preempt_handler``)."""

    signal: str
    wait_s: float
    max_requeues: int

    def restart(self) -> int:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)

    def allowed(self) -> bool:
        return self.restart() < self.max_requeues

    def requeue(self) -> None:
        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True, timeout=60,
                       capture_output=True)


def master_port(job_id: str, restart: int) -> int:
    """A port derived from the job (and cluster), the same on every task; a requeue gets a new one."""
    key = f"{os.environ.get('SLURM_CLUSTER_NAME', '')}:{os.environ.get('SLURM_CONF', '')}:{job_id}:{restart}"
    low, high = _PORT_RANGE
    return low + zlib.crc32(key.encode()) % (high - low)


def export_rank_env() -> dict[str, str]:
    """RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT from SLURM's
    task variables (as submitit's TorchDistributedEnvironment, with a port unique per cluster)."""
    from submitit import JobEnvironment

    job = JobEnvironment()
    env = {
        "RANK": str(job.global_rank), "WORLD_SIZE": str(job.num_tasks), "LOCAL_RANK": str(job.local_rank),
        "LOCAL_WORLD_SIZE": str(job.num_tasks // max(1, job.num_nodes)), "MASTER_ADDR": job.hostnames[0],
        "MASTER_PORT": str(master_port(os.environ.get("SLURM_JOB_ID", job.job_id),
                                       int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))),
    }
    os.environ.update(env)
    return env


@dataclass(frozen=True)
class SlurmRank:
    """What every SLURM task runs (submitit pickles it): the rank's environment, then ``rank_main``."""

    spec: RankSpec

    def __call__(self) -> dict[str, Any]:
        export_rank_env()
        os.environ[ATTEMPT_VAR] = os.environ.get("SLURM_RESTART_COUNT", "0") or "0"
        try:
            return rank_main(self.spec)
        except Preempted:
            sys.__stdout__.flush()
            sys.__stderr__.flush()
            os._exit(0)


# ----------------------------------------------------------------------------- submission
def submitit_folder(plan: LaunchPlan, shared: Path | None = None) -> Path:
    """submitit's folder: in the run directory, or ``shared`` (a sweep's job arrays)."""
    return ((shared or plan.run_dir) / plan.config["launcher"]["folder"]).absolute()


def sbatch_parameters(plan: LaunchPlan) -> dict[str, Any]:
    """The submitit SlurmExecutor parameters (sbatch names) for this plan."""
    lc = plan.config["launcher"]
    params: dict[str, Any] = {
        "job_name": lc["job_name"], "nodes": lc["nodes"],
        "ntasks_per_node": slurm_tasks_per_node(lc, plan.world_size), "cpus_per_task": lc["cpus_per_task"],
        "time": lc["time_min"], "signal_delay_s": lc["signal_delay_s"],
        "srun_args": ["--kill-on-bad-exit=1", *lc["srun_args"]],
        "additional_parameters": {"requeue": True, **dict(lc["sbatch_extra"] or {})},
    }
    if lc["gpus_per_node"]:
        params["gpus_per_node"] = lc["gpus_per_node"]
    if lc["mem_gb"] is not None:
        from submitit.slurm.slurm import _convert_mem

        params["mem"] = _convert_mem(float(lc["mem_gb"]))
    for key in ("partition", "account", "qos", "constraint", "exclude"):
        if lc[key]:
            params[key] = lc[key]
    if lc["setup"]:
        params["setup"] = list(lc["setup"])
    return params


def _submit_command(folder: Path) -> str:
    return " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(str(folder))])


def sbatch_script(plan: LaunchPlan, shared: Path | None = None, array: int | None = None) -> str:
    """The exact sbatch script submitit submits for this plan (``array``: the job array's size)."""
    from submitit.slurm.slurm import _make_sbatch_string

    folder = submitit_folder(plan, shared)
    return _make_sbatch_string(command=_submit_command(folder), folder=folder, map_count=array,
                               **sbatch_parameters(plan))


def describe(plan: LaunchPlan) -> str:
    """The submission as text, then the sbatch script (``launcher.dry_run``)."""
    lc = plan.config["launcher"]
    tpn = slurm_tasks_per_node(lc, plan.world_size)
    return "\n".join([
        f"launcher      slurm (submitit), {lc['nodes']} node(s) x {tpn} task(s) = {plan.world_size} rank(s)",
        f"task          {plan.task}",
        (f"time limit    {lc['time_min']} min; USR2 {lc['signal_delay_s']} s before it "
         f"(on_preempt hooks, up to {lc['max_requeues']} requeue(s))"),
        f"wait          {lc['wait']}",
        f"run dir       {plan.run_dir}",
        f"submitit      {submitit_folder(plan)}",
        "",
        "sbatch script:",
        sbatch_script(plan),
    ])


def _rank_spec(plan: LaunchPlan, launch_time: float) -> RankSpec:
    lc = plan.config["launcher"]
    return RankSpec(config=plan.config, run_dir=str(plan.run_dir.absolute()), threads_per_rank=lc["cpus_per_task"],
                    console_ranks=lc.get("console_ranks"), launch_time=launch_time,
                    max_log_mb=float(lc.get("max_log_mb") or 0),
                    preempt=SlurmRequeue(os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"),
                                         float(lc["preempt_wait_s"]), lc["max_requeues"]))


def _executor(plan: LaunchPlan, shared: Path | None = None) -> Any:
    from submitit import SlurmExecutor

    ex = SlurmExecutor(folder=submitit_folder(plan, shared), max_num_timeout=plan.config["launcher"]["max_requeues"])
    ex.update_parameters(**sbatch_parameters(plan))
    return ex


def _plan_info(plan: LaunchPlan) -> dict[str, Any]:
    return {"launcher": "slurm", "task": plan.task, "overrides": plan.overrides, "run_dir": str(plan.run_dir),
            "environment": rundir.environment_info()}


def _record_job(plan: LaunchPlan, job_id: str, folder: Path, submitted_at: float) -> dict[str, Any]:
    lc = plan.config["launcher"]
    record = {"job_id": job_id, "folder": str(folder), "submitted_at": submitted_at,
              "nodes": lc["nodes"], "tasks_per_node": slurm_tasks_per_node(lc, plan.world_size),
              "world_size": plan.world_size, "info": _plan_info(plan),
              "status_command": f"python -m wf_launch.status {plan.run_dir}"}
    rundir.atomic_write_json(plan.run_dir / JOB_FILE, record)
    return record


@dataclass
class Pending:
    """A prepared, not yet submitted run (sweep points wait in :data:`_BATCH`)."""

    plan: LaunchPlan
    fn: SlurmRank
    launch_time: float


_BATCH: list[Pending] | None = None


def begin_batch() -> None:
    """From now on :func:`launch` prepares runs for :func:`submit_batch` instead of submitting."""
    global _BATCH
    _BATCH = []


def drop_batch() -> None:
    """Forget the prepared runs without submitting them (the sweep was interrupted)."""
    global _BATCH
    _BATCH = None


def submit_batch(shared: Path) -> list[tuple[Pending, str | None, str]]:
    """Submit every prepared run: one job array per distinct sbatch shape, all at once.

    Returns (run, job id or None, error) per run; a refused group is recorded as failed.
    """
    global _BATCH
    runs, _BATCH = _BATCH or [], None
    groups: dict[str, list[Pending]] = {}
    for run in runs:
        key = json.dumps([sbatch_parameters(run.plan), run.plan.config["launcher"]["folder"]], sort_keys=True)
        groups.setdefault(key, []).append(run)
    out: list[tuple[Pending, str | None, str]] = []
    for group in groups.values():
        ex = _executor(group[0].plan, shared)
        submitted_at = time.time()
        try:
            with ex.batch():
                jobs = [ex.submit(run.fn) for run in group]
        except Exception as exc:
            message = f"sbatch refused the job array: {type(exc).__name__}: {exc}"
            for run in group:
                RunRecord.finalize(run.plan.run_dir, Status.FAILED, **_plan_info(run.plan),
                                   failure={"cause": "launcher_error", "type": type(exc).__name__,
                                            "message": str(exc)})
                out.append((run, None, message))
                print(f"wf_launch: {run.plan.run_dir}: {message}", file=sys.stderr, flush=True)
            continue
        for run, job in zip(group, jobs):
            _record_job(run.plan, job.job_id, ex.folder, submitted_at)
            out.append((run, job.job_id, ""))
        logger.info(f"submitted {len(group)} point(s) as job array {jobs[0].job_id.split('_')[0]}")
    return out


def launch(plan: LaunchPlan) -> RunOutcome:
    """Submit the run (or queue it for a sweep's batch); wait for it unless ``launcher.wait=false``."""
    lc = plan.config["launcher"]
    launch_time = time.time()
    fn = SlurmRank(_rank_spec(plan, launch_time))
    if _BATCH is not None:
        _BATCH.append(Pending(plan, fn, launch_time))
        return RunOutcome(Status.SUBMITTED, plan.run_dir)
    ex = _executor(plan)
    job = ex.submit(fn)
    _record_job(plan, job.job_id, ex.folder, launch_time)
    logger.info(f"submitted SLURM job {job.job_id}: {plan.world_size} rank(s), task={plan.task}, "
                f"run dir {plan.run_dir}")
    if not lc["wait"]:
        return RunOutcome(Status.SUBMITTED, plan.run_dir,
                          f"submitted SLURM job {job.job_id}; status: python -m wf_launch.status {plan.run_dir}")
    return wait_all([plan.run_dir], lc["poll_interval_s"])[0]


# ----------------------------------------------------------------------------- state and outcome
def job_state(job_id: str) -> str:
    """sacct's state of the job ('PENDING', 'RUNNING', 'CANCELLED by 0' ...); 'UNKNOWN' if not listed yet."""
    try:
        out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "UNKNOWN"
    states = [line.split("|", 1)[1] for line in out.stdout.splitlines()
              if "|" in line and line.split("|", 1)[0] == job_id]
    return states[-1].strip() if states else "UNKNOWN"


def in_queue(job_id: str) -> bool:
    """Whether squeue still lists the job (pending, running, or completing: processes not yet gone)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and bool(out.stdout.strip())


def wait_gone(job_id: str, timeout_s: float = 60) -> bool:
    """Wait until SLURM has cleaned the job up (its processes are gone); False on timeout."""
    deadline = time.monotonic() + timeout_s
    while in_queue(job_id):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.3)
    return True


def is_terminal(state: str) -> bool:
    return state.split()[0] in TERMINAL_STATES if state else False


def read_job(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``slurm_job.json`` (None for a run not submitted to SLURM)."""
    return rundir.read_json(Path(run_dir) / JOB_FILE)


def _layout(run_dir: Path) -> Any:
    import yaml

    return layout_of(yaml.safe_load((Path(run_dir) / rundir.CONFIG).read_text()))


def finalize(run_dir: Path, state: str) -> RunOutcome:
    """Write the final ``result.json`` of a run whose SLURM job ended in ``state`` (idempotent)."""
    run_dir = Path(run_dir)
    job = read_job(run_dir) or {}
    record = RunRecord.read(run_dir)
    if record is not None and record.final:
        return RunOutcome.of(record, run_dir, "")
    word = state.split()[0]
    info = {**job.get("info", {}), "slurm": {"job_id": job.get("job_id"), "state": state,
                                             "folder": job.get("folder")}}
    info["timings"] = {"wall_s": round(time.time() - job.get("submitted_at", time.time()), 4)}
    job_id = job.get("job_id")
    if word == "COMPLETED" and record is not None and record.status is Status.OK:
        return RunOutcome.of(RunRecord.finalize(run_dir, Status.OK, **info), run_dir)
    if word == "CANCELLED":
        summary = f"SLURM job {job_id} was cancelled ({state})"
        record = RunRecord.finalize(run_dir, Status.CANCELLED, **info,
                                    failure={"cause": "cancelled", "message": summary})
        return RunOutcome.of(record, run_dir, summary)
    if word == "TIMEOUT":
        summary = f"SLURM job {job_id} hit its time limit"
        record = RunRecord.finalize(run_dir, Status.TIMEOUT, **info, failure={"cause": "timeout", "message": summary})
        return RunOutcome.of(record, run_dir, summary)
    layout = _layout(run_dir)
    explained = explain_failure(run_dir, {}, lambda r: rank_label(r, layout.coords(r)), layout.coords)
    if explained is None:
        cause = {"rank": -1, "cause": "slurm", "type": word,
                 "message": f"SLURM job {job_id} ended {state} and no rank left a failure record; "
                            f"see {job.get('folder')}/{job_id}_*_log.err"}
        summary = cause["message"]
    else:
        cause, summary = explained
    record = RunRecord.finalize(run_dir, Status.FAILED, **info, failure=cause)
    return RunOutcome.of(record, run_dir, summary)


def cancel(run_dir: Path) -> str | None:
    """``scancel`` the run's job unless it already ended; returns the job id (None if no job)."""
    job = read_job(run_dir)
    if not job:
        return None
    if not is_terminal(job_state(job["job_id"])):
        subprocess.run(["scancel", job["job_id"]], check=False, capture_output=True, text=True, timeout=60)
    return job["job_id"]


def wait_all(run_dirs: list[Path], poll_s: float = 1.0) -> list[RunOutcome]:
    """Poll every run's job until all ended, finalizing (and reporting) each as it ends.

    Ctrl-C cancels every job still running, waits for SLURM to end it, and records 'cancelled'.
    """
    pending = {Path(d): read_job(d)["job_id"] for d in run_dirs}  # type: ignore[index]
    outcomes: dict[Path, RunOutcome] = {}
    many = len(run_dirs) > 1
    try:
        while pending:
            for run_dir, job_id in list(pending.items()):
                state = job_state(job_id)
                if is_terminal(state):
                    wait_gone(job_id)
                    outcome = finalize(run_dir, state)
                    outcomes[run_dir] = outcome
                    del pending[run_dir]
                    if many and outcome.exit_code:
                        print(f"wf_launch: {run_dir} {outcome.status}: {outcome.summary}", file=sys.stderr,
                              flush=True)
            if pending:
                time.sleep(poll_s)
    except KeyboardInterrupt:
        print(f"wf_launch: interrupted: cancelling {len(pending)} SLURM job(s)", file=sys.stderr, flush=True)
        for run_dir in pending:
            cancel(run_dir)
        deadline = time.monotonic() + 120
        while pending and time.monotonic() < deadline:
            for run_dir, job_id in list(pending.items()):
                state = job_state(job_id)
                if is_terminal(state):
                    wait_gone(job_id)
                    outcomes[run_dir] = finalize(run_dir, state)
                    del pending[run_dir]
            time.sleep(0.5)
    return [outcomes.get(Path(d)) or RunOutcome(Status.CANCELLED, Path(d), "not confirmed ended")
            for d in run_dirs]


def rank_outcomes(run_dir: Path) -> dict[int, str]:
    """Each rank's outcome as far as the run directory tells: ok, the exception, preempted, or running."""
    run_dir = Path(run_dir)
    job = read_job(run_dir) or {}
    world = int(job.get("world_size") or 0)
    record = RunRecord.read(run_dir)
    ok = set(record.results) if record is not None and record.status is Status.OK else set()
    stopped = str(record.status) if record is not None and record.status in (Status.CANCELLED, Status.TIMEOUT) \
        else None
    errors = {r["rank"]: r for r in load_failure_records(run_dir)}
    out: dict[int, str] = {}
    for rank in range(world):
        marker = rundir.read_json(preempt_marker(run_dir, rank))
        if str(rank) in ok:
            text = "ok"
        elif rank in errors:
            text = f"failed: {errors[rank]['type']}: {str(errors[rank]['message']).splitlines()[0][:200]}"
        elif stopped:
            text = f"stopped ({stopped})"
        elif rundir.rank_log(run_dir, rank).exists():
            text = "started (no outcome recorded)"
        else:
            text = "not started"
        if marker:
            text += f"; preemption signal at restart {marker['restart']} (hook: {marker['hook']})"
        out[rank] = text
    return out


@register_launcher
class SlurmLauncher:
    """One SLURM task per rank through submitit (``launcher=slurm``)."""

    name: ClassVar[str] = "slurm"
    config_class: ClassVar[type[LauncherConfig]] = SlurmLauncherConfig

    def validate(self, cfg: dict[str, Any], layout: Layout, engine: dict[str, Any]) -> None:
        validate_slurm_launcher(cfg, engine, layout.world_size)

    def describe(self, plan: LaunchPlan) -> str:
        return describe(plan)

    def launch(self, plan: LaunchPlan) -> RunOutcome:
        return launch(plan)

    def status(self, run_dir: Path) -> tuple[str, RunOutcome | None]:
        job = read_job(run_dir) or {}
        state = job_state(job["job_id"])
        if is_terminal(state) and not in_queue(job["job_id"]):
            return state, finalize(run_dir, state)
        return state, None

    def cancel(self, run_dir: Path) -> str | None:
        return cancel(run_dir)
