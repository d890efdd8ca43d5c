"""A SLURM run's job: ``slurm_job.json``, its state, signalling and cancelling it, and its
``result.json`` once it ended (with each rank's outcome; why it failed: :mod:`.failure`).

The state is sacct's, read by submitit's own watcher; without accounting, squeue's, scontrol's,
then the ranks' records (:class:`JobStates`). Job ids are checked before any command."""

from __future__ import annotations

import contextlib
import functools
import re
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from worldfoundry.core.validation import is_finite_number, is_int

from ...rundir import attempts, files
from ...rundir.failures import load_failure_records
from ...rundir.io import read_json
from ...rundir.outcome import RunOutcome
from ...rundir.placement import read_placement
from ...rundir.record import RecordError, RunRecord, Status
from ..interrupt import interrupted, name_ctrl_c
from .failure import explain_job_failure
from .submitit_adapter import job_watcher, refresh

JOB_FILE = files.SLURM_JOB
JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")
"""SLURM's job id syntax: '123', or '123_4' for a task of job array 123."""


def checked_job_id(job_id: Any, where: str = "job id") -> str:
    """``job_id`` if it is a SLURM job id; ValueError otherwise (it never reaches a command)."""
    if not isinstance(job_id, str) or not JOB_ID.fullmatch(job_id):
        raise ValueError(
            f"{where}: {job_id!r} is not a SLURM job id (123, or 123_4 for an array task); "
            "refusing to pass it to SLURM's commands"
        )
    return job_id


MAX_JOB_RANKS = 1 << 20
"""The most ranks a job file may name (status lists each rank; more is a corrupt file)."""

_RANKS = f"a number of ranks (at most {MAX_JOB_RANKS})"
_JOB_FIELDS: dict[str, tuple[Any, str]] = {
    "world_size": (lambda v: is_int(v) and 0 <= v <= MAX_JOB_RANKS, _RANKS),
    "nodes": (lambda v: is_int(v) and v >= 0, "a number of nodes"),
    "tasks_per_node": (lambda v: is_int(v) and v >= 0, "a number of tasks"),
    "submitted_at": (is_finite_number, "a time"),
    "folder": (lambda v: isinstance(v, str), "a path"),
    "info": (lambda v: isinstance(v, dict), "an object"),
}


def read_job(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``slurm_job.json`` (None: not submitted); ValueError naming a malformed field."""
    path = Path(run_dir) / JOB_FILE
    try:
        job = read_json(path)
    except OSError as exc:
        raise ValueError(f"{path}: not readable ({exc})") from None
    except ValueError as exc:
        raise ValueError(f"{exc}") from None
    if job is None:
        return None
    if not isinstance(job, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(job).__name__}")
    checked_job_id(job.get("job_id"), f"{path}: job_id")
    for key, (ok, what) in _JOB_FIELDS.items():
        if job.get(key) is not None and not ok(job[key]):
            raise ValueError(f"{path}: {key}={job[key]!r:.60} is not {what}")
    return job


_FORGOTTEN = (
    "SLURM no longer knows job {job} ({why}) and no rank left a result or a failure record; "
    "its outcome is unknown"
)
_STOPPED: dict[str, tuple[Status, str, str]] = {
    "CANCELLED": (Status.CANCELLED, "cancelled", "SLURM job {job} was cancelled ({state})"),
    "TIMEOUT": (Status.TIMEOUT, "timeout", "SLURM job {job} hit its time limit"),
    "UNKNOWN": (Status.UNKNOWN, "unknown", _FORGOTTEN),
}
"""The ends SLURM decided, by the first word of the job's state: (status, cause, summary)."""


def _final_info(run_dir: Path, job: dict[str, Any], state: str) -> dict[str, Any]:
    """The final record's job, timings, attempts and placement (the last attempt closed)."""
    world = int(job.get("world_size") or 0)
    last = attempts.count(run_dir) - 1
    placement = read_placement(run_dir, world)
    if last < 0 and placement:
        last = 0  # the ranks ran; rank 0 was killed before it recorded its attempt
    if last >= 0:
        ended = "completed" if state.split()[0] == "COMPLETED" else f"SLURM {state}"
        with contextlib.suppress(OSError):  # a full disk: the run is still recorded
            attempts.close(run_dir, last, world or 1, ended)
    return {
        **job.get("info", {}),
        "slurm": {"job_id": job.get("job_id"), "state": state, "folder": job.get("folder")},
        "timings": {"wall_s": round(time.time() - job.get("submitted_at", time.time()), 4)},
        "attempts": attempts.collect(run_dir),
        "placement": placement,
    }


def finalize(run_dir: Path, state: str) -> RunOutcome:
    """Write the final ``result.json`` of a run whose job ended in ``state`` (idempotent)."""
    run_dir = Path(run_dir)
    job = read_job(run_dir) or {}
    record = RunRecord.read(run_dir)
    if record is not None and record.final:
        return RunOutcome.of(record, run_dir, "")
    word = state.split()[0]
    info = _final_info(run_dir, job, state)
    if word == "COMPLETED" and record is not None and record.status is Status.OK:
        return RunOutcome.of(RunRecord.finalize(run_dir, Status.OK, **info), run_dir)
    if word in _STOPPED:
        status, cause, text = _STOPPED[word]
        why = state.partition(" ")[2] or "no accounting"
        summary = text.format(job=job.get("job_id"), state=state, why=why)
        failure = {"cause": cause, "message": summary}
    else:
        status = Status.FAILED
        failure, summary = explain_job_failure(run_dir, job, state)
    record = RunRecord.finalize(run_dir, status, **info, failure=failure)
    return RunOutcome.of(record, run_dir, summary)


def finalize_stopped(run_dir: Path, state: str, name: str) -> RunOutcome:
    """Write the final ``result.json`` of a run its launcher stopped with signal ``name``
    (SIGINT: a Ctrl-C): ``interrupted``, with the command that resumes it; ``ok`` when the job
    completed its task before the stop reached it (idempotent)."""
    run_dir = Path(run_dir)
    record = RunRecord.read(run_dir)
    if record is not None and record.final:
        return RunOutcome.of(record, run_dir, "")
    job = read_job(run_dir) or {}
    info = _final_info(run_dir, job, state)
    last = info["attempts"][-1] if info["attempts"] else {}
    by_flag = str(last.get("ended_by") or "").startswith("stop flag")
    completed = state.split()[0] == "COMPLETED" and record is not None
    if completed and record.status is Status.OK and not by_flag:  # type: ignore[union-attr]
        return RunOutcome.of(RunRecord.finalize(run_dir, Status.OK, **info), run_dir)
    if name == "SIGINT" and last:
        with contextlib.suppress(OSError):  # the record's words, never a lost record
            name_ctrl_c(run_dir, int(last.get("attempt", len(info["attempts"]) - 1)))
            info["attempts"] = attempts.collect(run_dir)
    summary = (
        f"stopped by {name}: every rank stopped at a step boundary (stop flag)"
        if by_flag
        else f"interrupted by {name}: SLURM job {job.get('job_id')} was cancelled"
    )
    return interrupted(run_dir, name, summary, **info)


def rank_outcomes(run_dir: Path) -> dict[int, str]:
    """Each rank's outcome as far as the run directory tells (ok, its failure, stopped ...)."""
    run_dir = Path(run_dir)
    world = int((read_job(run_dir) or {}).get("world_size") or 0)
    record = RunRecord.read(run_dir)
    ok = set(record.results) if record is not None and record.status is Status.OK else set()
    stops = (Status.CANCELLED, Status.TIMEOUT)
    stopped = str(record.status) if record is not None and record.status in stops else None
    errors = {r["rank"]: r for r in load_failure_records(run_dir)}
    return {
        rank: _rank_text(run_dir, rank, str(rank) in ok, errors.get(rank), stopped)
        + _preempt_note(run_dir, rank)
        for rank in range(world)
    }


def _rank_text(
    run_dir: Path, rank: int, ok: bool, error: dict[str, Any] | None, stopped: str | None
) -> str:
    """One rank's outcome: ok, its failure, the run's stop, or how far its log tells."""
    if ok:
        return "ok"
    if error is not None:
        first = (str(error.get("message") or "").splitlines() or [""])[0]
        return f"failed: {error.get('type')}: {first[:200]}"
    if stopped:
        return f"stopped ({stopped})"
    if files.rank_log(run_dir, rank).exists():
        return "started (no outcome recorded)"
    return "not started"


def _preempt_note(run_dir: Path, rank: int) -> str:
    """'; preemption signal at restart 0 (hook: saved)' when the rank recorded one."""
    try:
        marker = read_json(files.rank_preempt(run_dir, rank), 1 << 20)
    except (OSError, ValueError):
        return "; unreadable preemption record"
    if not isinstance(marker, dict) or "restart" not in marker:
        return ""
    return f"; preemption signal at restart {marker.get('restart')} (hook: {marker.get('hook')})"


_ENDS = "COMPLETED FAILED CANCELLED TIMEOUT OUT_OF_MEMORY NODE_FAIL PREEMPTED BOOT_FAIL DEADLINE"
TERMINAL_STATES = frozenset([*_ENDS.split(), "UNKNOWN"])
SACCT_RETRY_S = 300.0
"""After sacct failed, how long SLURM's other commands answer alone before it is asked again."""


def _run(args: list[str]) -> str | None:
    """The command's output; None when it failed or printed nothing."""
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def _squeue(job_id: str) -> list[str] | None:
    """squeue's [state, reason, nodes] of the job; None once it left the queue."""
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%r|%N"])
    return [*out.splitlines()[0].strip().split("|"), "", ""][:3] if out else None


def _scontrol_state(job_id: str) -> str | None:
    found = re.search(r"\bJobState=(\S+)", _run(["scontrol", "-o", "show", "job", job_id]) or "")
    return found.group(1) if found else None


def _records_state(run_dir: Path | None) -> str | None:
    if run_dir is None:
        return None
    with contextlib.suppress(RecordError):
        if (record := RunRecord.read(run_dir)) is not None and record.status is Status.OK:
            return "COMPLETED"
    return "FAILED" if load_failure_records(run_dir) else None


class JobStates:
    """The states of SLURM jobs: sacct through submitit's watcher (one call per :meth:`refresh`
    for every job), then squeue, scontrol and the run's records. A sacct that failed is left
    alone for :data:`SACCT_RETRY_S`; one instance serves the process (:data:`STATES`)."""

    def __init__(self) -> None:
        self._sacct_off_until = 0.0

    @functools.cached_property
    def _watcher(self) -> Any:
        """Made on first use: submitit is imported when a job is first asked about."""
        return job_watcher()

    def refresh(self, job_ids: Iterable[str]) -> None:
        """Ask sacct about these jobs (and every other one watched that has not ended)."""
        if time.monotonic() < self._sacct_off_until:
            return
        if not refresh(self._watcher, [checked_job_id(j) for j in job_ids]):
            self._sacct_off_until = time.monotonic() + SACCT_RETRY_S

    def state(self, job_id: str, run_dir: Path | None = None) -> str:
        """The job's state at the last :meth:`refresh`, else from the others; or 'UNKNOWN'."""
        job_id = checked_job_id(job_id)
        known = self._watcher.get_state(job_id, mode="cache")
        if known != "UNKNOWN":
            return known
        queued = (_squeue(job_id) or [None])[0]
        return queued or _scontrol_state(job_id) or _records_state(run_dir) or "UNKNOWN"


STATES = JobStates()
"""The process's job states (one submitit watcher for every job it asks about)."""


def job_state(job_id: str, run_dir: Path | None = None) -> str:
    """The job's state ('PENDING', 'CANCELLED by 0' ...) from the first source that knows it."""
    STATES.refresh([job_id])
    return STATES.state(job_id, run_dir)


def live_state(run_dir: Path) -> tuple[str, str] | None:
    """('SLURM job 42', 'PENDING (Priority)' or 'RUNNING on n[1-2]'); None once it left."""
    job_id = (read_job(run_dir) or {}).get("job_id")
    queued = _squeue(checked_job_id(job_id)) if job_id else None
    if queued is None:
        return None
    state, reason, nodes = queued
    if state == "PENDING":
        state = f"PENDING ({reason})" if reason and reason != "None" else "PENDING"
    elif nodes:
        state = f"{state} on {nodes}"
    return f"SLURM job {job_id}", state


def queue_state(job_id: str) -> str | None:
    """squeue's state of the job now ('PENDING', 'RUNNING', 'COMPLETING' ...); None once it
    left the queue."""
    return (_squeue(checked_job_id(job_id)) or [None])[0]


def in_queue(job_id: str) -> bool:
    """Whether squeue still lists the job (pending, running, or completing)."""
    return _squeue(checked_job_id(job_id)) is not None


def wait_gone(job_id: str, timeout_s: float = 60) -> None:
    """Wait (at most ``timeout_s``) until SLURM has cleaned the job up (its processes gone)."""
    deadline = time.monotonic() + timeout_s
    while in_queue(job_id) and time.monotonic() < deadline:
        time.sleep(0.3)


def is_terminal(state: str) -> bool:
    return state.split()[0] in TERMINAL_STATES if state else False


def cancel(run_dir: Path) -> str | None:
    """``scancel`` the run's job unless it already ended; the job id (None: no job)."""
    job = read_job(run_dir)
    if not job:
        return None
    job_id = checked_job_id(job["job_id"])
    if not is_terminal(job_state(job_id, Path(run_dir))):
        scancel(job_id)
    return job_id


def scancel(job_id: str, *options: str) -> bool:
    """``scancel [options] job_id`` (``--signal=USR2``: signal its steps); whether it worked."""
    args = ["scancel", *options, checked_job_id(job_id)]
    try:
        return subprocess.run(args, capture_output=True, timeout=60, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def signal_ranks(run_dir: Path, signum: int) -> set[int]:
    """``scancel --signal`` to the run's job (its steps: every rank, on any node); the ranks
    expected to get it (none once the job ended)."""
    job = read_job(run_dir)
    if not job or is_terminal(job_state(job["job_id"], Path(run_dir))):
        return set()
    name = signal.Signals(signum).name.removeprefix("SIG")
    sent = scancel(job["job_id"], f"--signal={name}")
    return set(range(int(job.get("world_size") or 0))) if sent else set()
