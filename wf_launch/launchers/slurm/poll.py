"""Asking SLURM about jobs: state (``sacct``), still queued (``squeue``), cancel, and waiting for runs."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from ...outcome import RunOutcome
from ...record import Status
from .finalize import finalize, read_job

__all__ = ["TERMINAL_STATES", "cancel", "in_queue", "is_terminal", "job_state", "wait_all", "wait_gone"]

TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
                             "PREEMPTED", "BOOT_FAIL", "DEADLINE"})


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
