"""A waiting launcher stops on SIGTERM and SIGHUP as on Ctrl-C: it cancels what it started.

The schedulers' launchers (SLURM, Ray) wait in the launching command for runs that live
elsewhere. Inside :func:`stop_signals` SIGTERM and SIGHUP raise :class:`Stopped` and SIGINT
raises ``KeyboardInterrupt``, so one ``except`` clause cancels the runs and records them.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..rundir import attempts
from ..rundir.outcome import RunOutcome
from ..rundir.record import RunRecord, Status
from ..rundir.resume import resume_hint

__all__ = [
    "CTRL_C_STOP",
    "FORWARDED_CTRL_C",
    "STRAGGLER_GRACE_S",
    "Stopped",
    "interrupted",
    "name_ctrl_c",
    "say",
    "stop_signals",
]

FORWARDED_CTRL_C = "stop flag: SIGTERM"
"""How rank 0 records the stop a launcher sends its ranks for a Ctrl-C (ranks ignore SIGINT)."""
CTRL_C_STOP = "stop flag: SIGINT (Ctrl-C)"
"""What the attempt's record says of that stop: the user pressed Ctrl-C."""

STRAGGLER_GRACE_S = 5.0
"""How long ranks have to stop after a launcher is signalled before their stacks are shown."""


def say(message: str) -> None:
    """One line to the user's console (stderr), as every launcher writes its notices."""
    print(f"wf_launch: {message}", file=sys.stderr, flush=True)


def interrupted(run_dir: Path, name: str, summary: str, /, **facts: Any) -> RunOutcome:
    """Record a run stopped by signal ``name``; its outcome, with the command that resumes it
    (``facts``: the record's fields, its ``overrides`` among them)."""
    record = RunRecord.finalize(
        run_dir,
        Status.INTERRUPTED,
        signal_name=name,
        **facts,
        failure={"cause": "interrupt", "signal": name, "message": summary},
    )
    hint = resume_hint(run_dir, facts.get("overrides"))
    return RunOutcome.of(record, run_dir, f"{summary}\n  {hint}" if hint else summary)


def name_ctrl_c(run_dir: Path, attempt: int) -> None:
    """The attempt a Ctrl-C stopped says so, on every launcher (its rank 0 recorded the SIGTERM
    the launcher passed the Ctrl-C on as)."""
    marker = attempts.read(run_dir, attempt) or {}
    if marker.get("ended_by") == FORWARDED_CTRL_C:
        attempts.update(run_dir, attempt, ended_by=CTRL_C_STOP)


class Stopped(Exception):
    """The launching command got SIGTERM or SIGHUP (SIGINT arrives as KeyboardInterrupt)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


@contextlib.contextmanager
def stop_signals(active: bool = True) -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`Stopped` while open (main thread only; else a no-op)."""
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise Stopped(signal.Signals(signum).name)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
