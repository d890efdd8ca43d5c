"""What experiment trackers cost the training loop: ``ctx.progress`` with trackers against without.

A rank's ``ctx.progress(step, total, loss=..., lr=...)`` appends to ``metrics.jsonl``; with
``tracking=...`` it also queues the point for the tracker thread (TensorBoard, MLflow's file store,
W&B offline), which writes and flushes every ``flush_s``. This times N calls per round, alternating
rounds of the plain reporter and of the reporter with the real trackers (each round a fresh run
directory), and prints the median ratio; then the time a rank waits at its end for the trackers to
write what they hold (``close``), against the same calls without trackers. No absolute time is
asserted anywhere.

    python scripts/bench_tracking.py [--calls 20000] [--rounds 5] [--trackers tensorboard mlflow
    wandb]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wf_launch.rank.progress import ProgressReporter
from wf_launch.rank.trackers import open_trackers


class _Quiet:
    def warning(self, text: str) -> None:
        print(f"  warning: {text}", file=sys.stderr)

    def debug(self, text: str) -> None:
        pass


def _round(calls: int, trackers: list[str]) -> tuple[float, float]:
    """(seconds for the calls, seconds for the close) in a fresh run directory."""
    with tempfile.TemporaryDirectory(prefix="wf-bench-tracking-") as tmp:
        run_dir = Path(tmp) / "run"
        (run_dir / "logs").mkdir(parents=True)
        config = {
            "task": {"name": "bench"},
            "tracking": {
                "flush_s": 1.0,
                "close_timeout_s": 120,
                **{t: {"enabled": True} for t in trackers},
            },
        }
        sink = open_trackers(config, run_dir, 0, "bench-run", 0, _Quiet()) if trackers else None
        if sink is not None:
            time.sleep(
                3.0
            )  # let the trackers open (imports, W&B's service): the loop never waits for it
        reporter = ProgressReporter(run_dir, 0, sink=sink)
        t0 = time.perf_counter()
        for step in range(1, calls + 1):
            reporter(step, calls, loss=1.0 / step, lr=1e-3)
        loop = time.perf_counter() - t0
        t0 = time.perf_counter()
        reporter.close("ok")
        return loop, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--trackers", nargs="+", default=["tensorboard", "mlflow", "wandb"])
    args = ap.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    plain, tracked, closes, bare_closes = [], [], [], []
    for _ in range(args.rounds):
        loop, close = _round(args.calls, [])
        plain.append(loop)
        bare_closes.append(close)
        loop, close = _round(args.calls, args.trackers)
        tracked.append(loop)
        closes.append(close)
    ratio = statistics.median(t / p for t, p in zip(tracked, plain))
    per_call = statistics.median(plain) / args.calls * 1e6
    print(
        f"ctx.progress with {'+'.join(args.trackers)}: {ratio:.2f}x the plain call "
        f"(median of {args.rounds} alternating rounds of {args.calls} calls; plain call "
        f"~{per_call:.1f} us here)"
    )
    print(
        "a rank's end (close: write what is queued, record the status): "
        f"{statistics.median(closes):.2f} s with "
        f"trackers, {statistics.median(bare_closes):.3f} s without"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
