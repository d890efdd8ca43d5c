"""Repeated 32-rank launches never stall (a short ``scripts/launch_loops.py``), and the fork gate
holds.

Before the fork gate, about one 32-rank launch in N on a loaded 2-core machine left
a rank blocked forever in ``getnameinfo`` (glibc's resolver lock, inherited held
from the launcher's TCPStore server thread at fork); see
``wf_launch.launchers.local.agent.ForkGate``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wf_launch.launchers.local.agent import ForkGate

ROOT = Path(__file__).resolve().parents[1]


def test_fork_gate_holds_forked_workers_until_released() -> None:
    gate = ForkGate()
    gate.arm()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker
        os.close(r)
        gate.wait()
        os.write(w, b"go")
        os._exit(0)
    os.close(w)
    time.sleep(0.3)
    os.set_blocking(r, False)
    with pytest.raises(BlockingIOError):
        os.read(r, 2)  # still held at the gate
    gate.release(1)
    os.set_blocking(r, True)
    assert os.read(r, 2) == b"go"
    assert os.waitpid(pid, 0)[1] == 0
    os.close(r)


def test_unarmed_fork_gate_does_not_wait() -> None:
    ForkGate().wait()
    ForkGate().release(3)


@pytest.mark.slow
def test_repeated_32_rank_launches_do_not_stall(tmp_path: Path) -> None:
    # A stalled rank never times out here (5 min); the launch's 45 s limit catches it.
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "launch_loops.py"),
            "--runs",
            "4",
            "--ranks",
            "32",
            "--timeout-min",
            "5",
            "--limit-s",
            "45",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
