"""Fault tolerance: one ``train`` run of N steps with one ``kill -9`` of one rank at N/2, two ways.

- (a) ``ft=torchft ft.replicas=2``: only the killed rank's replica group restarts and heals from
  its peer, the other keeps stepping;
- (b) today's checkpoint-and-restart: the same world (``engine.dp_size`` doubled, no ft),
  ``launcher.max_restarts=1``, a checkpoint every K steps: every rank restarts and resumes.

Each is reported as its wall time over its own failure-free run, measured in the same
invocation (goal: (a) <= 1.15x and clearly below (b)); and the failure-free step time of ft
over that of the same world without ft (goal: <= 1.10x); and ft's time from the kill to the
rejoin. Prints one ``ratio`` line per figure.

    python scripts/bench_ft.py [--steps 40] [--checkpoint-every 10] [--repeats 1] [OVERRIDES...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from wf_launch.launchers.ft_record import read_steps

COMMON = ["task=train", "task.save_final=false"]


def _steps(metrics: Path) -> list[tuple[float, int]]:
    """(time, step) of each step rank 0 reported in ``metrics`` (a run's ``metrics.jsonl``)."""
    return [(t, step) for t, step, _ in read_steps(metrics.parent)]


def _run(run_dir: Path, args: list[str], kill_at: int | None, metrics: Path) -> dict[str, Any]:
    """One launch to its end; with ``kill_at``, kill -9 the watched rank when it reaches it."""
    cmd = [sys.executable, "-m", "wf_launch", *COMMON, *args, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "WF_PROGRESS_PUBLISH_S": "0"}
    t0 = time.monotonic()
    with open(f"{run_dir}.out", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    if kill_at is not None:
        while max((s for _, s in _steps(metrics)), default=0) < kill_at:
            if proc.poll() is not None:
                raise SystemExit(f"the run ended before step {kill_at}: {run_dir}.out")
            time.sleep(0.05)
        pids = sorted(metrics.parent.glob("logs/rank*.pid"), key=lambda p: int(p.name[4:-4]))
        pid = json.loads(pids[-1].read_text())["pid"]  # the watched world's last rank
        os.kill(pid, signal.SIGKILL)
    rc = proc.wait()
    wall = time.monotonic() - t0
    if rc != 0:
        raise SystemExit(f"run failed (exit {rc}): {run_dir}.out")
    record = json.loads((run_dir / "result.json").read_text())
    return {"wall": wall, "record": record, "steps": _steps(metrics)}


def _step_time(steps: list[tuple[float, int]]) -> float:
    """Median seconds per step, from rank 0's metrics (start-up excluded)."""
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(steps) if b[1] == a[1] + 1]
    return statistics.median(gaps[1:] or gaps)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--dp", type=int, default=1, help="engine.dp_size of one replica group")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "overrides", nargs="*", help="for every run, e.g. a larger model: task.hidden=256"
    )
    args = ap.parse_args()
    n, half = args.steps, args.steps // 2
    work = Path(tempfile.mkdtemp(prefix="wf_bench_ft_"))
    ft = ["ft=torchft", "ft.replicas=2", f"engine.dp_size={args.dp}", f"task.steps={n}"]
    ft += args.overrides
    plain = [f"engine.dp_size={2 * args.dp}", f"task.steps={n}", *args.overrides]
    restart = [*plain, "launcher.max_restarts=1", f"task.checkpoint_every={args.checkpoint_every}"]
    rows: dict[str, list[Any]] = {k: [] for k in ("ft0", "ft1", "pl0", "pl1")}
    for i in range(args.repeats):  # alternating, so machine noise hits every kind alike
        d = work / str(i)
        d.mkdir()
        ft_metrics = lambda name: d / name / "replicas" / "1" / "metrics.jsonl"  # noqa: E731
        rows["ft0"].append(_run(d / "ft0", ft, None, ft_metrics("ft0")))
        rows["pl0"].append(_run(d / "pl0", plain, None, d / "pl0" / "metrics.jsonl"))
        rows["ft1"].append(_run(d / "ft1", ft, half, ft_metrics("ft1")))
        rows["pl1"].append(_run(d / "pl1", restart, half, d / "pl1" / "metrics.jsonl"))
    med = {k: statistics.median(r["wall"] for r in v) for k, v in rows.items()}
    step_ft = statistics.median(_step_time(r["steps"]) for r in rows["ft0"])
    step_pl = statistics.median(_step_time(r["steps"]) for r in rows["pl0"])
    rejoin = [
        rec["seconds_to_rejoin"] for r in rows["ft1"] for rec in r["record"]["ft"]["recoveries"]
    ]
    print(f"steps {n}, kill -9 of one rank at step {half}, {args.repeats} repeat(s), in {work}")
    print(
        f"wall: ft free {med['ft0']:.1f} s, ft killed {med['ft1']:.1f} s, "
        f"restart free {med['pl0']:.1f} s, restart killed {med['pl1']:.1f} s"
    )
    print(f"ratio (a) ft killed / ft free: {med['ft1'] / med['ft0']:.3f}x (goal <= 1.15x)")
    print(f"ratio (b) checkpoint-restart killed / free: {med['pl1'] / med['pl0']:.3f}x")
    print(
        f"ratio ft step time / same world without ft: {step_ft / step_pl:.3f}x "
        f"({step_ft:.3f} s vs {step_pl:.3f} s; goal <= 1.10x)"
    )
    print(f"kill to rejoin (ft): {rejoin} s")


if __name__ == "__main__":
    main()
