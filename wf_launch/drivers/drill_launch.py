"""How a drill starts and stops the CLI: one launch into a run directory, in its own session, its
console output in an owner-only log (the plain drill and the fault-tolerance drill alike)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from ..rank.progress import PUBLISH_ENV
from ..rundir.io import open_log

__all__ = ["STOP_GRACE_S", "finish_launch", "launch_cli", "stop_launch", "terminated_as_exit"]

STOP_GRACE_S = 60.0
"""How long a launch stopped by SIGTERM has to end (its ranks save, a Ray or SLURM launcher
ends its actors or job) before its process group is killed."""


def launch_cli(overrides: list[str], run_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    """``python -m wf_launch OVERRIDES`` into ``run_dir`` (its own session, output to ``log``);
    every rank publishes its progress at every step, so interruptions land at the step asked for."""
    env = {**os.environ, PUBLISH_ENV: "0"}
    with os.fdopen(open_log(log), "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "wf_launch", *overrides, f"hydra.run.dir={run_dir}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )


def stop_launch(proc: subprocess.Popen[bytes] | None, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the launch's process group, SIGKILL it after ``grace_s``. SIGTERM first: a Ray
    launcher then ends its supervisors and rank actors and a SLURM launcher cancels its job,
    where a SIGKILL of the launcher would leave them running on the cluster."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def finish_launch(proc: subprocess.Popen[bytes], deadline: float) -> int | None:
    """The launch's exit code once it ends; None when it was still running at ``deadline`` (a
    ``time.monotonic()``), and it has been stopped. However the wait ends, interrupted too, no
    launch is left running (:func:`stop_launch`)."""
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None
    finally:
        stop_launch(proc)


def _exit_on(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextmanager
def terminated_as_exit() -> Iterator[None]:
    """A SIGTERM to the drill leaves it as Ctrl-C does: by an exception, so that it stops the
    launch it started (in a session of its own, the launch gets no signal of the terminal or of
    a ``kill`` of the drill) instead of leaving it running."""
    previous = signal.signal(signal.SIGTERM, _exit_on)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
