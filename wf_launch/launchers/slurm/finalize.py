"""A SLURM run's final record: ``slurm_job.json``, ``result.json`` once the job ended, and
each rank's outcome."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from worldfoundry.core.validation import is_finite_number, is_int

from ...config.layout import rank_label, run_layout
from ...observe.rootcause import explain_failure
from ...rundir import attempts, files
from ...rundir.failures import load_failure_records
from ...rundir.io import read_json
from ...rundir.outcome import RunOutcome
from ...rundir.placement import read_placement
from ...rundir.record import RunRecord, Status

__all__ = ["JOB_FILE", "JOB_ID", "checked_job_id", "finalize", "rank_outcomes", "read_job"]

JOB_FILE = files.SLURM_JOB


JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")
"""SLURM's job id syntax: '123', or '123_4' for a task of job array 123."""


def checked_job_id(job_id: Any, where: str = "job id") -> str:
    """``job_id`` if it is a SLURM job id; ValueError otherwise (it never reaches a command
    line)."""
    if not isinstance(job_id, str) or not JOB_ID.fullmatch(job_id):
        raise ValueError(
            f"{where}: {job_id!r} is not a SLURM job id (123, or 123_4 for an array task); "
            "refusing to pass it to SLURM's commands"
        )
    return job_id


MAX_JOB_RANKS = 1 << 20
"""The most ranks a job file may name (status lists each rank; more is a corrupt file, not
a job)."""

_JOB_FIELDS: dict[str, tuple[Any, str]] = {
    "world_size": (
        lambda v: is_int(v) and 0 <= v <= MAX_JOB_RANKS,
        f"a number of ranks (at most {MAX_JOB_RANKS})",
    ),
    "nodes": (lambda v: is_int(v) and v >= 0, "a number of nodes"),
    "tasks_per_node": (lambda v: is_int(v) and v >= 0, "a number of tasks"),
    "submitted_at": (is_finite_number, "a time"),
    "folder": (lambda v: isinstance(v, str), "a path"),
    "info": (lambda v: isinstance(v, dict), "an object"),
}


def read_job(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``slurm_job.json`` (None for a run not submitted to SLURM).

    ValueError (naming the file and the field) when it cannot be read, its job id is not a
    SLURM job id, or a field the launcher reads has the wrong type.
    """
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


_STOPPED: dict[str, tuple[Status, str, str]] = {
    "CANCELLED": (Status.CANCELLED, "cancelled", "SLURM job {job} was cancelled ({state})"),
    "TIMEOUT": (Status.TIMEOUT, "timeout", "SLURM job {job} hit its time limit"),
    "UNKNOWN": (
        Status.UNKNOWN,
        "unknown",
        "SLURM no longer knows job {job} ({why}) and no rank left a result or a failure "
        "record; its outcome is unknown",
    ),
}
"""The ends SLURM itself decided, by the first word of the job's state: (status, cause,
summary)."""


def _final_info(run_dir: Path, job: dict[str, Any], state: str) -> dict[str, Any]:
    """What the final record holds beyond the outcome: the job, timings, attempts, placement.

    Closes the last attempt with how the job ended.
    """
    world = int(job.get("world_size") or 0)
    last = attempts.count(run_dir) - 1
    if last >= 0:
        ended = "completed" if state.split()[0] == "COMPLETED" else f"SLURM {state}"
        try:
            attempts.close(run_dir, last, world or 1, ended)
        except OSError:  # a full disk: the run is still recorded
            pass
    return {
        **job.get("info", {}),
        "slurm": {"job_id": job.get("job_id"), "state": state, "folder": job.get("folder")},
        "timings": {"wall_s": round(time.time() - job.get("submitted_at", time.time()), 4)},
        "attempts": attempts.collect(run_dir),
        "placement": read_placement(run_dir, world),
    }


def _failure(run_dir: Path, job: dict[str, Any], state: str) -> tuple[dict[str, Any], str]:
    """The failure record and summary of a job that failed: what the ranks recorded, or
    SLURM's word and where its logs are."""
    layout = run_layout(files.read_config(run_dir, strict=True))
    explained = explain_failure(
        run_dir, {}, lambda r: rank_label(r, layout.coords(r)), layout.coords, layout.world_size
    )
    if explained is not None:
        return explained
    job_id = job.get("job_id")
    message = (
        f"SLURM job {job_id} ended {state} and no rank left a failure record; "
        f"see {job.get('folder')}/{job_id}_*_log.err"
    )
    cause = {"rank": -1, "cause": "slurm", "type": state.split()[0], "message": message}
    return cause, message


def finalize(run_dir: Path, state: str) -> RunOutcome:
    """Write the final ``result.json`` of a run whose SLURM job ended in ``state``
    (idempotent)."""
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
        failure, summary = _failure(run_dir, job, state)
    return RunOutcome.of(
        RunRecord.finalize(run_dir, status, **info, failure=failure), run_dir, summary
    )


def rank_outcomes(run_dir: Path) -> dict[int, str]:
    """Each rank's outcome as far as the run directory tells: ok, the exception, preempted,
    or running."""
    run_dir = Path(run_dir)
    world = int((read_job(run_dir) or {}).get("world_size") or 0)
    record = RunRecord.read(run_dir)
    ok = set(record.results) if record is not None and record.status is Status.OK else set()
    stopped = (
        str(record.status)
        if record is not None and record.status in (Status.CANCELLED, Status.TIMEOUT)
        else None
    )
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
    """'; preemption signal at restart 0 (hook: saved)' when the rank recorded one (nothing
    for a malformed file)."""
    try:
        marker = read_json(files.rank_preempt(run_dir, rank), 1 << 20)
    except (OSError, ValueError):
        return "; unreadable preemption record"
    if not isinstance(marker, dict) or "restart" not in marker:
        return ""
    return f"; preemption signal at restart {marker.get('restart')} (hook: {marker.get('hook')})"
