"""Waiting for SLURM runs, and stopping them the way every launcher stops its runs.

:func:`wait_all` polls the runs' jobs until each has ended, finalizing each as it ends. A
Ctrl-C, SIGTERM or SIGHUP of the waiting command stops the runs as the local launcher stops its
ranks (:class:`_Wait.stop`):

- a running job's steps get SIGTERM (``scancel --signal=TERM``): every rank's stop flag, so a
  task that polls ``ctx.should_stop()`` saves at its next step boundary and returns;
- ranks still running :data:`STRAGGLER_GRACE_S` later are shown where they are (their
  grouped stacks);
- jobs still running ``launcher.signal_delay_s`` later (the time SLURM gives a rank to save
  before its time limit), or at a second Ctrl-C, are cancelled; a job still queued is
  cancelled at once;
- each run is recorded ``interrupted`` (exit 130 for Ctrl-C, 143 for SIGTERM), with the
  command that resumes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from ...config.layout import rank_label, run_layout
from ...observe.live import LiveView
from ...observe.stacks import live_autopsy
from ...rundir import files
from ...rundir.outcome import RunOutcome
from ...rundir.record import Status
from ..base import CTRL_C_NOTICE
from ..interrupt import STRAGGLER_GRACE_S, Stopped, say, stop_signals
from .poll import (
    STATES,
    checked_job_id,
    finalize,
    finalize_stopped,
    in_queue,
    is_terminal,
    live_state,
    queue_state,
    read_job,
    scancel,
    signal_ranks,
    wait_gone,
)

__all__ = ["CANCEL_WAIT_S", "DEFAULT_STOP_WAIT_S", "UNKNOWN_GRACE_S", "wait_all"]

UNKNOWN_GRACE_S = 30.0
"""How long a job known to no SLURM command (and with no record) is waited for."""
CANCEL_WAIT_S = 120.0
"""How long a wait waits for SLURM to end the jobs it cancelled."""
DEFAULT_STOP_WAIT_S = 90.0
"""How long stopped ranks have to save and return when the run's config names no
``launcher.signal_delay_s``."""


def _stop_wait_s(run_dir: Path) -> float:
    """The run's ``launcher.signal_delay_s``: how long its ranks have to save after a stop."""
    launcher = files.read_config(run_dir).get("launcher")
    value = launcher.get("signal_delay_s") if isinstance(launcher, dict) else None
    return float(value) if isinstance(value, (int, float)) and value > 0 else DEFAULT_STOP_WAIT_S


@dataclass
class _StopClock:
    """Where a stop is: since when, its grace, whether stragglers were shown, the cancel."""

    grace: float
    started: float = field(default_factory=time.monotonic)
    shown: bool = False
    cancelled_at: float | None = None

    def waited(self) -> float:
        return time.monotonic() - self.started

    def gave_up(self) -> bool:
        """:data:`CANCEL_WAIT_S` after the cancel: SLURM did not end the jobs."""
        cancelled = self.cancelled_at
        return cancelled is not None and time.monotonic() - cancelled > CANCEL_WAIT_S


class _Wait:
    """The runs a wait still waits for, the outcome of each that ended, and the stop asked of
    them (``stopping``: run dir -> the signal's name)."""

    def __init__(self, run_dirs: list[Path]) -> None:
        self.pending = {
            Path(d): checked_job_id((read_job(d) or {}).get("job_id")) for d in run_dirs
        }
        self.outcomes: dict[Path, RunOutcome] = {}
        self.unknown_since: dict[Path, float] = {}
        self.stopping: dict[Path, str] = {}
        self.report = len(run_dirs) > 1

    def poll(self, cancelling: bool = False) -> None:
        """Finalize every run whose job ended (one sacct call); ``cancelling``: unlisted = ended."""
        STATES.refresh(self.pending.values())
        for run_dir, job_id in list(self.pending.items()):
            state = STATES.state(job_id, run_dir)
            if cancelling and not is_terminal(state) and not in_queue(job_id):
                state = "CANCELLED"
            if not (is_terminal(state) if cancelling else self._ended(run_dir, job_id, state)):
                continue
            wait_gone(job_id)
            name = self.stopping.get(run_dir)
            outcome = self.outcomes[run_dir] = (
                finalize(run_dir, state) if name is None else finalize_stopped(run_dir, state, name)
            )
            del self.pending[run_dir]
            if self.report and outcome.exit_code and name is None:
                say(f"{run_dir} {outcome.status}: {outcome.summary}")

    def _ended(self, run_dir: Path, job_id: str, state: str) -> bool:
        """Whether the job ended; an unknown job once the grace passed."""
        if state.split()[0] == "UNKNOWN" and not in_queue(job_id):
            first = self.unknown_since.setdefault(run_dir, time.monotonic())
            return time.monotonic() - first >= UNKNOWN_GRACE_S
        if not is_terminal(state):
            self.unknown_since.pop(run_dir, None)
            return False
        return True

    def cancel(self, why: str) -> None:
        """Cancel every job still pending (its ranks stop where they are)."""
        say(f"{why}: cancelling {len(self.pending)} SLURM job(s)")
        for job_id in self.pending.values():
            scancel(job_id)

    def stop(self, name: str, poll_s: float, live: LiveView) -> None:
        """Stop every run as every launcher does (see the module's docstring); returns once each
        has ended and is recorded, or :data:`CANCEL_WAIT_S` after its cancel."""
        if name == "SIGINT":
            logger.warning(CTRL_C_NOTICE)
        grace = max((_stop_wait_s(d) for d in self.pending), default=DEFAULT_STOP_WAIT_S)
        clock = _StopClock(grace)
        self.stopping.update(dict.fromkeys(self.pending, name))
        try:
            with stop_signals():  # a second Ctrl-C already: cancel
                for job_id in self.pending.values():
                    queued = queue_state(job_id)  # squeue's word now (sacct's may be stale)
                    if not (queued == "RUNNING" and scancel(job_id, "--signal=TERM")):
                        scancel(job_id)  # still queued (nothing ran), or no step to reach
        except (KeyboardInterrupt, Stopped):
            self.cancel("asked again")
            clock.cancelled_at = time.monotonic()
        while self.pending and not clock.gave_up():
            try:
                with stop_signals():
                    self._stop_tick(name, clock, live)
                    time.sleep(poll_s)
            except (KeyboardInterrupt, Stopped):
                if clock.cancelled_at is None:
                    self.cancel("asked again")
                    clock.cancelled_at = time.monotonic()

    def _stop_tick(self, name: str, clock: _StopClock, live: LiveView) -> None:
        """One poll of a stop: cancel what outlived the grace, record what ended, and show the
        ranks still running once :data:`STRAGGLER_GRACE_S` has passed."""
        if clock.cancelled_at is None and clock.waited() > clock.grace:
            self.cancel(f"still running {clock.grace:g} s after the {_what(name)}")
            clock.cancelled_at = time.monotonic()
        live.tick()
        self.poll(cancelling=clock.cancelled_at is not None)
        if self.pending and not clock.shown and clock.waited() > STRAGGLER_GRACE_S:
            clock.shown = True
            self._show_stragglers(name)

    def _show_stragglers(self, name: str) -> None:
        """The ranks of every run still running, where they are (as the local launcher shows
        them :data:`STRAGGLER_GRACE_S` after a stop)."""
        for run_dir in list(self.pending):
            coords = (layout := run_layout(files.read_config(run_dir))).coords
            answered, lines = live_autopsy(
                run_dir,
                layout.world_size,
                lambda r, coords=coords: rank_label(r, coords(r)),  # type: ignore[misc]
                signal_ranks,
            )
            if not answered:
                continue
            logger.warning(
                f"{run_dir}: ranks still running {STRAGGLER_GRACE_S:g} s after the {_what(name)}; "
                "where they are (their job is cancelled at launcher.signal_delay_s, or at a "
                "second Ctrl-C):"
            )
            for line in lines:
                logger.warning(line)


def _what(name: str) -> str:
    return "Ctrl-C" if name == "SIGINT" else name


def wait_all(run_dirs: list[Path], poll_s: float = 1.0) -> list[RunOutcome]:
    """Poll every run's job until all ended, finalizing (and reporting) each as it ends; a stop
    signal stops every run still running (see the module's docstring)."""
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
        wait.stop(exc.name if isinstance(exc, Stopped) else "SIGINT", poll_s, live)
    live.close()
    gone = "not confirmed ended"
    return [wait.outcomes.get(Path(d)) or RunOutcome(Status.CANCELLED, d, gone) for d in run_dirs]
