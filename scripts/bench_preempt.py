"""From SLURM's preemption warning to the job back in the queue, against one step + one save + 3 s.

Needs a running cluster (``SLURM_CONF``). Per repetition: submit ``task=train`` on
``--nodes`` nodes (``launcher.wait=false``), let it run past a few checkpoints, then
``scancel --signal=USR2`` the job and poll ``scontrol show job`` every 20 ms until it
shows ``Restarts=1`` and state ``PENDING`` (requeued and its allocation released: back in
the queue; ``RUNNING`` if it was already started again between two polls). The baseline comes from
the same run:
one step (median interval between rank 0's steps in ``metrics.jsonl``) plus one save
(the extra time of the steps that saved a checkpoint) plus 3 s. Prints each
repetition and the median ratio; the job is cancelled afterwards.

    .venv/bin/python scripts/bench_preempt.py --nodes 2 --reps 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rank0_steps(run_dir: Path) -> list[tuple[float, int]]:
    out = []
    try:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec.get("rank") == 0:
                out.append((float(rec["time"]), int(rec["step"])))
    except (OSError, ValueError):
        pass
    return out


def _restarts(job: str) -> tuple[int, str]:
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=10
    ).stdout
    fields = dict(w.split("=", 1) for w in out.split() if "=" in w)
    return int(fields.get("Restarts", "-1")), fields.get("JobState", "?")


def one(root: Path, nodes: int, every: int, sleep_s: float) -> dict[str, float]:
    run_dir = root / f"run-{time.time_ns()}"
    env = {**os.environ, "WF_PROGRESS_PUBLISH_S": "0"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "launcher=slurm",
            "launcher.wait=false",
            "task=train",
            f"launcher.nodes={nodes}",
            f"engine.dp_size={nodes}",
            "task.steps=100000",
            f"task.checkpoint_every={every}",
            f"task.step_sleep_s={sleep_s}",
            f"hydra.run.dir={run_dir}",
        ],
        check=True,
        capture_output=True,
        env=env,
        cwd=root,
    )
    job = json.loads((run_dir / "slurm_job.json").read_text())["job_id"]
    try:
        deadline = time.monotonic() + 300
        while len(_rank0_steps(run_dir)) < 4 * every + 2:
            if time.monotonic() > deadline:
                raise SystemExit(f"job {job} made no progress; see {run_dir}")
            time.sleep(0.2)
        steps = _rank0_steps(run_dir)
        gaps = [(b[0] - a[0], a[1]) for a, b in itertools.pairwise(steps) if b[1] == a[1] + 1]
        plain = statistics.median(g for g, s in gaps if s % every)
        saving = statistics.median(g for g, s in gaps if s % every == 0)
        step_at_signal = steps[-1][1]
        t0 = time.time()
        subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
        counted = None
        while True:
            restarts, state = _restarts(job)
            if restarts >= 1 and counted is None:
                counted = time.time() - t0
            if restarts >= 1 and state in ("PENDING", "RUNNING"):
                # the old allocation is released: the job is back in the queue (or already started
                # again)
                break
            if time.time() - t0 > 300:
                raise SystemExit(
                    f"job {job} was not back in the queue within 300 s (state {state})"
                )
            time.sleep(0.02)
        requeued = time.time() - t0
        stopped = max(s for _, s in _rank0_steps(run_dir))
    finally:
        subprocess.run(
            [sys.executable, "-m", "wf_launch.status", "--cancel", str(run_dir)],
            capture_output=True,
            timeout=180,
            env=env,
        )
    baseline = plain + max(0.0, saving - plain) + 3.0
    return {
        "requeue_s": requeued,
        "counted_s": counted,
        "step_s": plain,
        "save_s": max(0.0, saving - plain),
        "baseline_s": baseline,
        "ratio": requeued / baseline,
        "steps_after_signal": stopped - step_at_signal,
        "state": state,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--step-sleep-s", type=float, default=0.05)
    args = p.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory(prefix="wf_bench_preempt_") as tmp:
        for rep in range(args.reps):
            r = one(Path(tmp), args.nodes, args.checkpoint_every, args.step_sleep_s)
            ratios.append(r["ratio"])
            print(
                f"rep {rep}: USR2 -> Restarts=1 {r['counted_s']:.2f} s, -> {r['state']} with "
                "Restarts=1 "
                f"{r['requeue_s']:.2f} s; baseline "
                f"{r['baseline_s']:.2f} s (step {r['step_s']:.3f} + save {r['save_s']:.3f} + 3); "
                f"ratio {r['ratio']:.2f}; steps run after the signal {r['steps_after_signal']}",
                flush=True,
            )
    print(
        "median ratio (requeue time / (one step + one save + 3 s)): "
        f"{statistics.median(ratios):.2f}"
    )


if __name__ == "__main__":
    main()
