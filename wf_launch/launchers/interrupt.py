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

from ..rundir.outcome import RunOutcome
from ..rundir.record import RunRecord, Status
from ..rundir.resume import resume_hint

__all__ = ["Stopped", "interrupted", "say", "stop_signals"]


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
