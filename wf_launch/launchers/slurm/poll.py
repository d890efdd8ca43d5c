"""Asking SLURM about jobs: state, queue state, still queued, cancel, and waiting for runs.

The state comes from ``sacct`` (accounting); where accounting is missing (no
slurmdbd, or it is down) from ``squeue`` while the job is queued, then from
``scontrol show job`` while the controller remembers it, then from the ranks'
own records in the run directory. A job that none of them knows is ``UNKNOWN``;
:func:`wait_all` ends such a run after :data:`UNKNOWN_GRACE_S` with a clear
message instead of polling for ever. While it waits it shows the run live
(:class:`~wf_launch.observe.live.LiveView`, with :func:`live_state` for the queue state and
SLURM's reason). SIGTERM and SIGHUP to a waiting launcher
are handled like Ctrl-C: the jobs are cancelled, waited for and finalized.
Every job id is checked against SLURM's syntax before it reaches a command.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ...observe.live import LiveView
from ...rundir.failures import load_failure_records
from ...rundir.outcome import RunOutcome
from ...rundir.record import RecordError, RunRecord, Status
from .finalize import checked_job_id, finalize, read_job

__all__ = [
    "TERMINAL_STATES",
    "UNKNOWN_GRACE_S",
    "cancel",
    "in_queue",
    "is_terminal",
    "job_state",
    "live_state",
    "queue_state",
    "wait_all",
    "wait_gone",
]

TERMINAL_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "OUT_OF_MEMORY",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "UNKNOWN",
    }
)
UNKNOWN_GRACE_S = 30.0
"""How long a job may be known to no SLURM command (and leave no record) before its wait ends as unknown."""


def _run(args: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _sacct_state(job_id: str) -> str | None:
    out = _run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State"])
    if out is None or out.returncode != 0:
        return None
    states = [
        line.split("|", 1)[1]
        for line in out.stdout.splitlines()
        if "|" in line and line.split("|", 1)[0] == job_id
    ]
    return states[-1].strip() if states else None


def _squeue_state(job_id: str) -> str | None:
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
    if out is None or out.returncode != 0:
        return None
    return out.stdout.strip().splitlines()[0].strip() if out.stdout.strip() else None


def _scontrol_state(job_id: str) -> str | None:
    out = _run(["scontrol", "-o", "show", "job", job_id])
    if out is None or out.returncode != 0:
        return None
    found = re.search(r"\bJobState=(\S+)", out.stdout)
    return found.group(1) if found else None


def _records_state(run_dir: Path | None) -> str | None:
    if run_dir is None:
        return None
    try:
        record = RunRecord.read(run_dir)
    except RecordError:
        record = None
    if record is not None and record.status is Status.OK:
        return "COMPLETED"
    if load_failure_records(run_dir):
        return "FAILED"
    return None


def job_state(job_id: str, run_dir: Path | None = None) -> str:
    """The job's state ('PENDING', 'RUNNING', 'CANCELLED by 0' ...), from the first source that knows it.

    sacct, then squeue, then scontrol, then (with ``run_dir``) the ranks' records;
    'UNKNOWN' when none does (not listed yet, or forgotten without accounting).
    """
    job_id = checked_job_id(job_id)
    for source in (_sacct_state, _squeue_state, _scontrol_state):
        state = source(job_id)
        if state:
            return state
    return _records_state(run_dir) or "UNKNOWN"


def queue_state(job_id: str) -> str | None:
    """'PENDING (Resources)' or 'RUNNING on n[1-2]' from squeue; None once the job left the queue."""
    out = _run(["squeue", "-h", "-j", checked_job_id(job_id), "-o", "%T|%r|%N"])
    line = (
        out.stdout.strip().splitlines()[0]
        if out is not None and out.returncode == 0 and out.stdout.strip()
        else ""
    )
    if not line:
        return None
    state, reason, nodes = [*line.split("|"), "", ""][:3]
    if state == "PENDING":
        return f"PENDING ({reason})" if reason and reason != "None" else "PENDING"
    return f"{state} on {nodes}" if nodes else state


def live_state(run_dir: Path) -> tuple[str, str] | None:
    """('SLURM job 42', 'PENDING (Priority)') for the live view; None without a job or once it left the queue."""
    job = read_job(run_dir) or {}
    state = queue_state(job["job_id"]) if job.get("job_id") else None
    return (f"SLURM job {job['job_id']}", state) if state is not None else None


def in_queue(job_id: str) -> bool:
    """Whether squeue still lists the job (pending, running, or completing: processes not yet gone)."""
    return _squeue_state(checked_job_id(job_id)) is not None


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
    job_id = checked_job_id(job["job_id"])
    if not is_terminal(job_state(job_id, Path(run_dir))):
        subprocess.run(["scancel", job_id], check=False, capture_output=True, text=True, timeout=60)
    return job_id


class _Stop(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _stop_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`_Stop` in the waiting launcher (main thread only)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise _Stop(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _settle(
    run_dir: Path, job_id: str, state: str, unknown_since: dict[Path, float]
) -> RunOutcome | None:
    """The run's outcome if its job has ended (finalizing it), else None."""
    if state.split()[0] == "UNKNOWN" and not in_queue(job_id):
        first = unknown_since.setdefault(run_dir, time.monotonic())
        if time.monotonic() - first < UNKNOWN_GRACE_S:
            return None
    elif not is_terminal(state):
        unknown_since.pop(run_dir, None)
        return None
    wait_gone(job_id)
    return finalize(run_dir, state)


def wait_all(run_dirs: list[Path], poll_s: float = 1.0) -> list[RunOutcome]:
    """Poll every run's job until all ended, finalizing (and reporting) each as it ends.

    Ctrl-C, SIGTERM and SIGHUP cancel every job still running, wait for SLURM to end
    it, and record 'cancelled'. A job no SLURM command knows any more, whose ranks
    left no record, ends as 'unknown' after :data:`UNKNOWN_GRACE_S`.
    """
    from loguru import logger

    pending = {Path(d): read_job(d)["job_id"] for d in run_dirs}  # type: ignore[index]
    outcomes: dict[Path, RunOutcome] = {}
    unknown_since: dict[Path, float] = {}
    many = len(run_dirs) > 1
    live = LiveView(list(pending), write=logger.info, state_of=live_state)
    try:
        with _stop_signals():
            while pending:
                live.tick()
                for run_dir, job_id in list(pending.items()):
                    outcome = _settle(run_dir, job_id, job_state(job_id, run_dir), unknown_since)
                    if outcome is None:
                        continue
                    outcomes[run_dir] = outcome
                    del pending[run_dir]
                    if many and outcome.exit_code:
                        print(
                            f"wf_launch: {run_dir} {outcome.status}: {outcome.summary}",
                            file=sys.stderr,
                            flush=True,
                        )
                if pending:
                    time.sleep(poll_s)
    except (KeyboardInterrupt, _Stop) as exc:
        why = f"{exc}" if isinstance(exc, _Stop) else "interrupted"
        print(
            f"wf_launch: {why}: cancelling {len(pending)} SLURM job(s)", file=sys.stderr, flush=True
        )
        for run_dir in pending:
            cancel(run_dir)
        deadline = time.monotonic() + 120
        while pending and time.monotonic() < deadline:
            for run_dir, job_id in list(pending.items()):
                state = job_state(job_id, run_dir)
                if is_terminal(state) or not in_queue(job_id):
                    wait_gone(job_id)
                    outcomes[run_dir] = finalize(
                        run_dir, state if is_terminal(state) else "CANCELLED"
                    )
                    del pending[run_dir]
            time.sleep(0.5)
    live.close()
    return [
        outcomes.get(Path(d)) or RunOutcome(Status.CANCELLED, Path(d), "not confirmed ended")
        for d in run_dirs
    ]
