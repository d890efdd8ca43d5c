"""Ctrl-C against SIGTERM on a running ``task=train``: time to stop, and whether the task saved
first.

Each round starts ``python -m wf_launch task=train engine.dp_size=2`` (a long run, 0.1 s steps),
waits for step 5, then sends SIGINT to the whole process group (what a terminal's Ctrl-C does) or
SIGTERM to the launcher, alternating, and measures the time until the launcher exits and whether a
checkpoint of the step it stopped at exists. With ``--baseline DIR`` (another checkout) the same
rounds run with that code too. Prints medians and the Ctrl-C / SIGTERM ratio.

    python scripts/bench_ctrl_c.py [--rounds 3] [--baseline /tmp/base]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _step(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "logs" / "rank0.progress.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def one(tree: Path, sig: int) -> tuple[float, bool, int]:
    """(seconds from the signal to the launcher's exit, a checkpoint saved, exit code)."""
    with tempfile.TemporaryDirectory(prefix="wf-bench-ctrlc-") as tmp:
        run_dir = Path(tmp) / "run"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
        }
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "wf_launch",
                "task=train",
                "engine.dp_size=2",
                "task.steps=500",
                "task.step_sleep_s=0.1",
                f"hydra.run.dir={run_dir}",
            ],
            env=env,
            cwd=tmp,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while _step(run_dir) < 5 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        t0 = time.monotonic()
        if sig == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(sig)
        code = proc.wait(timeout=120)
        took = time.monotonic() - t0
        saved = (
            any((run_dir / "checkpoints").glob("step_*/COMMIT"))
            if (run_dir / "checkpoints").is_dir()
            else False
        )
        return took, saved, code


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", type=Path, default=None)
    args = ap.parse_args()
    trees = [("this tree", ROOT)] + (
        [("baseline", args.baseline.resolve())] if args.baseline else []
    )
    for name, tree in trees:
        ints, terms = [], []
        for _ in range(args.rounds):
            ints.append(one(tree, signal.SIGINT))
            terms.append(one(tree, signal.SIGTERM))
        med_int, med_term = (
            statistics.median(t for t, _, _ in ints),
            statistics.median(t for t, _, _ in terms),
        )
        print(
            f"{name}: Ctrl-C stops in {med_int:.2f} s (saved: "
            f"{sum(s for _, s, _ in ints)}/{args.rounds}, exit "
            f"{ints[-1][2]}), SIGTERM in {med_term:.2f} s (saved: "
            f"{sum(s for _, s, _ in terms)}/{args.rounds}); "
            f"Ctrl-C / SIGTERM = {med_int / med_term:.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
