"""Asking SLURM about jobs: state, queue state, still queued, cancel, and waiting for runs.

The state is sacct's, read by submitit's own watcher (``SlurmInfoWatcher``, through
:mod:`.submitit_adapter`): one ``sacct`` call per poll for every job waited on, ended jobs
cached. Where accounting is missing (no slurmdbd, or it is down) submitit answers
``UNKNOWN``; then ``squeue`` answers while the job is queued, ``scontrol show job`` while
the controller remembers it, then the ranks' own records in the run directory. A job that
none of them knows stays ``UNKNOWN``; :func:`wait_all` ends such a run after
:data:`UNKNOWN_GRACE_S` with a clear message instead of polling for ever. While it waits it
shows the run live (:class:`~wf_launch.observe.live.LiveView`, with :func:`live_state` for
the queue state and SLURM's reason). SIGTERM and SIGHUP to a waiting launcher are handled
like Ctrl-C: the jobs are cancelled, waited for and finalized. Every job id is checked
against SLURM's syntax before it reaches a command.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loguru import logger

from ...observe.live import LiveView
from ...rundir.failures import load_failure_records
from ...rundir.outcome import RunOutcome
from ...rundir.record import RecordError, RunRecord, Status
from ..interrupt import Stopped, stop_signals
from .finalize import checked_job_id, finalize, read_job
from .submitit_adapter import job_watcher, refresh

__all__ = [
    "STATES",
    "TERMINAL_STATES",
    "UNKNOWN_GRACE_S",
    "JobStates",
    "cancel",
    "in_queue",
    "is_terminal",
    "job_state",
    "live_state",
    "queue_state",
    "scancel",
    "wait_all",
    "wait_gone",
]

TERMINAL_STATES = frozenset(
    (
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
    )
)
UNKNOWN_GRACE_S = 30.0
"""How long a job may be known to no SLURM command (and leave no record) before its wait
ends as unknown."""
SACCT_RETRY_S = 300.0
"""After sacct failed, how long SLURM's other commands answer alone before it is asked again."""
CANCEL_WAIT_S = 120.0
"""How long an interrupted wait waits for SLURM to end the jobs it cancelled."""


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


def _squeue_state(job_id: str) -> str | None:
    return (_squeue(job_id) or [None])[0]


def _scontrol_state(job_id: str) -> str | None:
    found = re.search(r"\bJobState=(\S+)", _run(["scontrol", "-o", "show", "job", job_id]) or "")
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


class JobStates:
    """The states of SLURM jobs: sacct through submitit's watcher, one call per
    :meth:`refresh` for every job watched that has not ended; then squeue, scontrol and the
    run's records.

    One instance serves the process (:data:`STATES`), as submitit shares one watcher between
    all its jobs. When sacct fails (no accounting) it is not asked again for
    :data:`SACCT_RETRY_S`: its error would be printed on every poll, and the other commands
    answer.
    """

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
        """The job's state at the last :meth:`refresh`, or from the first other source that
        knows it; 'UNKNOWN' when none does."""
        job_id = checked_job_id(job_id)
        known = self._watcher.get_state(job_id, mode="cache")
        if known != "UNKNOWN":
            return known
        for source in (_squeue_state, _scontrol_state):
            state = source(job_id)
            if state:
                return state
        return _records_state(run_dir) or "UNKNOWN"


STATES = JobStates()
"""The process's job states (one submitit watcher for every job it asks about)."""


def job_state(job_id: str, run_dir: Path | None = None) -> str:
    """The job's state ('PENDING', 'RUNNING', 'CANCELLED by 0' ...), from the first source
    that knows it.

    sacct, then squeue, then scontrol, then (with ``run_dir``) the ranks' records;
    'UNKNOWN' when none does (not listed yet, or forgotten without accounting).
    """
    STATES.refresh([job_id])
    return STATES.state(job_id, run_dir)


def queue_state(job_id: str) -> str | None:
    """'PENDING (Resources)' or 'RUNNING on n[1-2]' from squeue; None once the job left the
    queue."""
    queued = _squeue(checked_job_id(job_id))
    if queued is None:
        return None
    state, reason, nodes = queued
    if state == "PENDING":
        return f"PENDING ({reason})" if reason and reason != "None" else "PENDING"
    return f"{state} on {nodes}" if nodes else state


def live_state(run_dir: Path) -> tuple[str, str] | None:
    """('SLURM job 42', 'PENDING (Priority)') for the live view; None without a job or once
    it left the queue."""
    job = read_job(run_dir) or {}
    state = queue_state(job["job_id"]) if job.get("job_id") else None
    return (f"SLURM job {job['job_id']}", state) if state is not None else None


def in_queue(job_id: str) -> bool:
    """Whether squeue still lists the job (pending, running, or completing: processes not
    yet gone)."""
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
    """``scancel`` the run's job unless it already ended; returns the job id (None if no
    job)."""
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


class _Wait:
    """The runs a wait still waits for, and the outcome of each that ended."""

    def __init__(self, run_dirs: list[Path]) -> None:
        self.pending = {
            Path(d): checked_job_id((read_job(d) or {}).get("job_id")) for d in run_dirs
        }
        self.outcomes: dict[Path, RunOutcome] = {}
        self.states = STATES
        self.unknown_since: dict[Path, float] = {}
        self.report = len(run_dirs) > 1

    def poll(self) -> None:
        """Finalize every run whose job ended (one sacct call for them all)."""
        self.states.refresh(self.pending.values())
        for run_dir, job_id in list(self.pending.items()):
            state = self.states.state(job_id, run_dir)
            if self._ended(run_dir, job_id, state):
                self._done(run_dir, finalize(run_dir, state))

    def _ended(self, run_dir: Path, job_id: str, state: str) -> bool:
        """Whether the job ended and SLURM cleaned it up; an unknown job once the grace passed."""
        if state.split()[0] == "UNKNOWN" and not in_queue(job_id):
            first = self.unknown_since.setdefault(run_dir, time.monotonic())
            if time.monotonic() - first < UNKNOWN_GRACE_S:
                return False
        elif not is_terminal(state):
            self.unknown_since.pop(run_dir, None)
            return False
        wait_gone(job_id)
        return True

    def _done(self, run_dir: Path, outcome: RunOutcome) -> None:
        self.outcomes[run_dir] = outcome
        del self.pending[run_dir]
        if self.report and outcome.exit_code:
            print(
                f"wf_launch: {run_dir} {outcome.status}: {outcome.summary}",
                file=sys.stderr,
                flush=True,
            )

    def cancel(self, why: str) -> None:
        """Cancel every job still pending, and finalize each as SLURM ends it."""
        print(
            f"wf_launch: {why}: cancelling {len(self.pending)} SLURM job(s)",
            file=sys.stderr,
            flush=True,
        )
        for run_dir in self.pending:
            cancel(run_dir)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while self.pending and time.monotonic() < deadline:
            self.states.refresh(self.pending.values())
            for run_dir, job_id in list(self.pending.items()):
                state = self.states.state(job_id, run_dir)
                if is_terminal(state) or not in_queue(job_id):
                    wait_gone(job_id)
                    self.outcomes[run_dir] = finalize(
                        run_dir, state if is_terminal(state) else "CANCELLED"
                    )
                    del self.pending[run_dir]
            time.sleep(0.5)

    def outcome(self, run_dir: Path) -> RunOutcome:
        return self.outcomes.get(run_dir) or RunOutcome(
            Status.CANCELLED, run_dir, "not confirmed ended"
        )


def wait_all(run_dirs: list[Path], poll_s: float = 1.0) -> list[RunOutcome]:
    """Poll every run's job until all ended, finalizing (and reporting) each as it ends.

    Ctrl-C, SIGTERM and SIGHUP cancel every job still running, wait for SLURM to end
    it, and record 'cancelled'. A job no SLURM command knows any more, whose ranks
    left no record, ends as 'unknown' after :data:`UNKNOWN_GRACE_S`.
    """
    wait = _Wait(run_dirs)
    live = LiveView(list(wait.pending), write=logger.info, state_of=live_state, warn=logger.warning)
    try:
        with stop_signals():
            while wait.pending:
                live.tick()
                wait.poll()
                if wait.pending:
                    time.sleep(poll_s)
    except (KeyboardInterrupt, Stopped) as exc:
        wait.cancel(exc.name if isinstance(exc, Stopped) else "interrupted")
    live.close()
    return [wait.outcome(Path(d)) for d in run_dirs]
