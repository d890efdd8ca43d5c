"""Press Ctrl-C while a launch forks its ranks, over and over, and count the bad endings.

Each launch is ``task=noop engine.dp_size=R`` in its own session. Once the launcher has its
first child, the whole process group gets SIGINT after a random delay of up to ``--spread-s``:
the moment when some ranks are still in multiprocessing's bootstrap and others are running.
A good ending is exit 130 within ``--stall-s`` of the Ctrl-C, no traceback on stderr, and no
process of the run left behind. Exits 1 on any bad ending. Before the fix of 2026-12-07, 1 in
20 launches (beside three CPU hogs) printed a rank's traceback and stalled 30 s.

    python scripts/ctrl_c_loop.py --runs 20 --ranks 8
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
MISSED = "missed: the run ended before the Ctrl-C came"


def _first_child(proc: subprocess.Popen, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if psutil.Process(proc.pid).children():
                return True
        except psutil.NoSuchProcess:
            return False
        time.sleep(0.002)
    return False


def _left_behind(marker: str) -> list[int]:
    time.sleep(2.0)
    return [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if marker in " ".join(p.info["cmdline"] or [])
    ]


def one(ranks: int, spread_s: float, stall_s: float, out: Path) -> str | None:
    """One launch and one Ctrl-C; what went wrong, or None."""
    run_dir = out / f"run-{time.monotonic_ns()}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "task=noop",
            f"engine.dp_size={ranks}",
            f"hydra.run.dir={run_dir}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        if not _first_child(proc, 120):
            proc.communicate(timeout=60)
            return f"no rank ever started (exit {proc.returncode})"
        time.sleep(random.uniform(0, spread_s))
        os.killpg(proc.pid, signal.SIGINT)
        pressed = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - pressed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode == 0:
        return MISSED
    if proc.returncode != 130 or "Traceback" in err:
        return f"exit {proc.returncode}:\n{err[-3000:]}"
    if took > stall_s:
        return f"exit 130 only {took:.1f} s after the Ctrl-C:\n{err[-3000:]}"
    left = _left_behind(str(run_dir))
    return f"processes left behind: {left}" if left else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--spread-s", type=float, default=0.3)
    ap.add_argument("--stall-s", type=float, default=10.0)
    ns = ap.parse_args()
    bad = missed = 0
    with tempfile.TemporaryDirectory(prefix="wf-ctrl-c-") as tmp:
        for i in range(ns.runs):
            problem = one(ns.ranks, ns.spread_s, ns.stall_s, Path(tmp))
            print(f"launch {i + 1}/{ns.runs}: {'ok' if problem is None else problem}", flush=True)
            missed += problem == MISSED
            bad += problem not in (None, MISSED)
    print(f"{ns.runs - bad - missed}/{ns.runs} ok, {bad} bad, {missed} missed (not a test of it)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
