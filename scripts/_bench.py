"""Shared by the command-timing benchmarks: run a command, return its wall time."""

from __future__ import annotations

import subprocess
import time


def timed(cmd: list[str], cwd: str) -> float:
    """Wall seconds of ``cmd`` run to completion in ``cwd``; exits with its stderr if it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return wall
