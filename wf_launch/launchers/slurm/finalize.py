"""A SLURM run's final record: ``slurm_job.json``, ``result.json`` once the job ended, each rank's outcome."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ... import rundir
from ...entrypoint import layout_of, preempt_marker
from ...outcome import RunOutcome
from ...ranklog import rank_label
from ...record import RunRecord, Status
from ...report import explain_failure, load_failure_records

__all__ = ["JOB_FILE", "finalize", "rank_outcomes", "read_job"]

JOB_FILE = "slurm_job.json"


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
