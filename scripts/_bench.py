"""Shared by the command-timing benchmarks: run a command, return its wall time."""

from __future__ import annotations

import subprocess
import time


def timed(cmd: list[str], cwd: str) -> float:
    """Wall seconds of ``cmd`` run to completion in ``cwd``; exits with its stderr if it fails."""
    wall = timed_or_stalled(cmd, cwd, None)
    assert wall is not None  # no timeout: it ran to the end
    return wall


def timed_or_stalled(cmd: list[str], cwd: str, timeout: float | None) -> float | None:
    """Like :func:`timed`, but a command still running after ``timeout`` s is killed (with its whole
    process group) and reported as ``None``: a stalled launch is a result, not a reason to hang."""
    import os
    import signal

    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{err[-3000:]}")
    return wall
