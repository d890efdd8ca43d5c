"""Run one ``ft=torchft`` drill over and over, optionally beside busy CPU load, and count passes.

A fault-tolerance fix is proven by loops, not one green run: the races between replica groups
(who times out first, who asks for a quorum first) change with the host's load. Each run is
``python -m wf_launch.drill OVERRIDES --inject INJECT --dir OUT/runN`` with a wall-clock limit;
``--load N`` keeps N busy-looping processes beside it (a CI host running two test workers).
Prints each run's verdict, wall time and recoveries; exits 1 on any failure.

``--lighthouse-at S`` instead launches the run itself and kills its Lighthouse once replica group
0 reports step S: the run must end ok, with the Lighthouse restarted and equal weights.

    python scripts/ft_drill_loop.py --runs 5 --load 2 --inject hang:replica1.rank1@6 -- \
        task=train ft=torchft engine.dp_size=2 ft.hang_timeout_s=4 ft.quorum_timeout_s=30 \
        task.steps=30 task.checkpoint_every=4 task.step_sleep_s=0.5
    python scripts/ft_drill_loop.py --runs 5 --lighthouse-at 3 -- \
        task=train ft=torchft engine.dp_size=2 task.steps=20
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from wf_launch.launchers.ft_record import read_steps
from wf_launch.rundir import files


def _spin() -> None:
    while True:
        pass


def _one(i: int, out: Path, inject: str, overrides: list[str], limit_s: float) -> bool:
    directory = out / f"run{i}"
    cmd = [sys.executable, "-m", "wf_launch.drill", *overrides, "--inject", inject]
    t0 = time.monotonic()
    try:
        done = subprocess.run(
            [*cmd, "--dir", str(directory)], capture_output=True, text=True, timeout=limit_s
        )
    except subprocess.TimeoutExpired:
        print(f"run {i}: STALL after {limit_s:.0f} s ({directory})", flush=True)
        return False
    wall = time.monotonic() - t0
    try:
        summary = json.loads((directory / "drill.json").read_text())
    except (OSError, ValueError):
        summary = {}
    recoveries = [
        (r.get("replica"), r.get("rank"), r.get("cause"), r.get("seconds_to_rejoin"))
        for r in summary.get("recoveries", [])
    ]
    verdict = "PASS" if done.returncode == 0 else f"FAIL rc={done.returncode}"
    print(f"run {i}: {verdict} in {wall:.1f} s; recoveries {recoveries}", flush=True)
    if done.returncode != 0:
        print(done.stdout[-2500:] + done.stderr[-2500:], flush=True)
    return done.returncode == 0


def _lighthouse_of(launcher: subprocess.Popen) -> psutil.Process | None:
    try:
        children = psutil.Process(launcher.pid).children(recursive=True)
    except psutil.Error:
        return None
    return next((p for p in children if "ft_lighthouse" in " ".join(p.cmdline())), None)


def _one_lighthouse(i: int, out: Path, at: int, overrides: list[str], limit_s: float) -> bool:
    """Launch the run, kill its Lighthouse once group 0 reports step ``at``; True if it ended ok
    with the Lighthouse restarted and equal weights."""
    run_dir = out / f"run{i}"
    log = out / f"run{i}.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "wf_launch", *overrides, f"hydra.run.dir={run_dir}"],
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    killed = False
    while launcher.poll() is None and time.monotonic() - t0 < limit_s:
        steps = read_steps(files.ft_replica_dir(run_dir, 0))
        if not killed and steps and steps[-1][1] >= at and (lh := _lighthouse_of(launcher)):
            lh.kill()
            killed = True
        time.sleep(0.1)
    if launcher.poll() is None:
        launcher.kill()
        print(f"run {i}: STALL after {limit_s:.0f} s ({run_dir})", flush=True)
        return False
    try:
        record = json.loads((run_dir / "result.json").read_text())
    except (OSError, ValueError):
        record = {}
    ft = record.get("ft") or {}
    ok = (
        launcher.returncode == 0
        and killed
        and record.get("status") == "ok"
        and ft.get("lighthouse_restarts", 0) >= 1
        and ft.get("weights_equal") is True
    )
    print(
        f"run {i}: {'PASS' if ok else 'FAIL'} in {time.monotonic() - t0:.1f} s; rc "
        f"{launcher.returncode}, Lighthouse killed {killed}, restarts "
        f"{ft.get('lighthouse_restarts')}, weights equal {ft.get('weights_equal')}",
        flush=True,
    )
    if not ok:
        print(log.read_text()[-2500:], flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--load", type=int, default=0, help="busy-looping processes beside each run")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--inject", help="the drill's --inject")
    kind.add_argument(
        "--lighthouse-at", type=int, help="kill the Lighthouse at this step of group 0 instead"
    )
    p.add_argument("--limit-s", type=float, default=600.0, help="wall-clock limit of one drill")
    p.add_argument("--out", default=None, help="drill directories go here (default: a temp dir)")
    p.add_argument("overrides", nargs="*", help="the run's overrides (after --)")
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="wf-ft-loop-"))
    out.mkdir(parents=True, exist_ok=True)
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.load)]
    for s in spinners:
        s.start()
    try:
        passed = sum(
            _one_lighthouse(i, out, args.lighthouse_at, args.overrides, args.limit_s)
            if args.lighthouse_at is not None
            else _one(i, out, args.inject, args.overrides, args.limit_s)
            for i in range(args.runs)
        )
    finally:
        for s in spinners:
            s.terminate()
            s.join()
    print(f"{passed}/{args.runs} passed (load {args.load}); drills in {out}")
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
