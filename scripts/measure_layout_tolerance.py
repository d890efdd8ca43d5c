"""Measure how far a ``train`` run continued at another layout lands from the straight run (the
tolerance).

1. A straight run at ``--from`` (default dp=4), ``--steps`` steps.
2. For each target layout: the same run stopped with SIGTERM once rank 0 reached
   ``--stop-at``, then relaunched with ``launcher.resume=true`` at the target layout.
3. For comparison, straight runs at some targets with the same global batch (no interruption).

Printed per case: the max abs difference of rank 0's loss curve, of the final loss, and of
every parameter of the final weights and EMA (exported from both runs' last checkpoints
with ``python -m wf_launch.checkpoint export``). docs/checkpointing.md quotes the table.

    python scripts/measure_layout_tolerance.py [--steps 40] [--stop-at 10] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGETS = {
    "cp=2 dp=2": ["engine.dp_size=2", "engine.cp_size=2"],
    "dp=2": ["engine.dp_size=2"],
    "pp=2 dp=2": ["engine.pp_size=2", "engine.dp_size=2"],
    "pp=2": ["engine.pp_size=2", "engine.dp_size=1"],
    "dp=1": ["engine.dp_size=1"],
    "cp=4": ["engine.cp_size=4", "engine.dp_size=1"],
    "dp=8": ["engine.dp_size=8"],
}
STRAIGHT = ("cp=2 dp=2", "pp=2 dp=2")


def _run(args: list[str], run_dir: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "wf_launch", *args, f"hydra.run.dir={run_dir}"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _stopped_then_resumed(
    base: list[str], start: list[str], target: list[str], run_dir: Path, stop_at: int
) -> None:
    env = {**os.environ, "WF_PROGRESS_PUBLISH_S": "0"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wf_launch",
            *base,
            *start,
            "task.step_sleep_s=0.2",
            f"hydra.run.dir={run_dir}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    progress = run_dir / "logs" / "rank0.progress.json"
    while True:
        try:
            if json.loads(progress.read_text())["step"] >= stop_at:
                break
        except (OSError, ValueError, KeyError):
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{run_dir}: the run ended before step {stop_at}")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait()
    _run([*base, *target, "launcher.resume=true"], run_dir)


def _final(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    import torch

    out = {}
    for flag, name in (([], "model"), (["--ema"], "ema")):
        path = run_dir / f"export-{name}.pt"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "wf_launch.checkpoint",
                "export",
                str(run_dir),
                "--out",
                str(path),
                *flag,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        out[name] = torch.load(path, weights_only=True)
    return (
        json.loads((run_dir / "result.json").read_text())["results"]["0"],
        out["model"],
        out["ema"],
    )


def _row(name: str, ref: tuple[Any, Any, Any], got: tuple[Any, Any, Any]) -> str:
    (r, rw, re_), (g, gw, ge) = ref, got
    curve = max(abs(a - b) for a, b in zip(r["loss_curve"], g["loss_curve"]))
    weights = max(float((rw[k] - gw[k]).abs().max()) for k in rw)
    ema = max(float((re_[k] - ge[k]).abs().max()) for k in re_)
    resumed = g["attempts"][-1]["resumed_from"]
    return (
        f"{name:<34s} loss curve {curve:.1e}  final loss "
        f"{abs(r['final_loss'] - g['final_loss']):.1e}  "
        f"weights {weights:.1e}  ema {ema:.1e}"
        + (f"  (resumed from step {resumed})" if resumed else "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--stop-at", type=int, default=10)
    parser.add_argument("--from", dest="start", default="engine.dp_size=4")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    base = ["task=train", f"task.steps={args.steps}"]
    start = args.start.split()
    out = Path(tempfile.mkdtemp(prefix="layout_tol_", dir=args.dir))
    try:
        _run([*base, *start], out / "straight")
        ref = _final(out / "straight")
        global_batch = ref[0]["global_batch"]
        print(
            f"train, {args.steps} steps, global batch {global_batch}, straight at {args.start}; "
            f"stopped at step >= {args.stop_at}, continued at:"
        )
        for i, (name, target) in enumerate(TARGETS.items()):
            _stopped_then_resumed(base, start, target, out / f"resumed{i}", args.stop_at)
            print(_row(name, ref, _final(out / f"resumed{i}")), flush=True)
        for i, name in enumerate(STRAIGHT):
            _run([*base, *TARGETS[name], f"task.global_batch={global_batch}"], out / f"straight{i}")
            print(
                _row(f"straight at {name} (no interruption)", ref, _final(out / f"straight{i}")),
                flush=True,
            )
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
