"""``ctx.progress(step, total, **metrics)`` on a rank: never a collective, a few microseconds per call.

A call with metrics appends one JSON line (rank, step, time, metrics) to
``RUN_DIR/metrics.jsonl``; lines are flushed with every publish (at most
``publish_s`` apart) and when the rank ends, so a crash loses at most the last
``publish_s`` of them. The rank's latest state is published to
``logs/rank{r}.progress.json`` (:mod:`wf_launch.rundir.progress`, atomically
replaced, at most every ``publish_s`` and on the first and last call): a file in
the run directory works the same for local ranks and for SLURM tasks on a shared
file system, and is read by the launcher's live view
(:mod:`wf_launch.observe.progress`), ``status --follow`` and the drill.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from ..rundir import files
from ..rundir.progress import plain, publish_state

__all__ = ["PUBLISH_ENV", "ProgressReporter", "publish_interval"]

PUBLISH_ENV = "WF_PROGRESS_PUBLISH_S"
"""Seconds between a rank's progress publications (default 0.5); the drill sets 0: every step is seen."""


def publish_interval(default: float = 0.5) -> float:
    """:data:`PUBLISH_ENV` if set to seconds >= 0, else ``default``."""
    try:
        value = float(os.environ.get(PUBLISH_ENV, default))
    except ValueError:
        return default
    return value if 0 <= value < float("inf") else default


class ProgressReporter:
    """One rank's progress: cheap to call at every step."""

    def __init__(self, run_dir: Path | str, rank: int, publish_s: float = 0.5, sink: Any = None) -> None:
        self.run_dir = Path(run_dir)
        self.sink = sink  # the rank's experiment trackers (a TrackerHub: ``log(step, metrics)``, ``close(status)``)
        self.rank = rank
        self.publish_s = publish_s
        self.step: int | None = None
        self.total: int | None = None
        self.metrics: dict[str, Any] = {}
        self._last_publish = -math.inf
        self._metrics_file: Any = None
        self._lock = threading.Lock()

    def __call__(self, step: int, total: int | None = None, **metrics: Any) -> None:
        now = time.time()
        self.step = int(step)
        if total is not None:
            self.total = int(total)
        if metrics:
            self.metrics = metrics
            self._append(now, metrics)
            if self.sink is not None:
                self.sink.log(self.step, metrics)
        if now - self._last_publish >= self.publish_s or (self.total is not None and self.step >= self.total):
            self.publish(now)

    def _append(self, now: float, metrics: dict[str, Any]) -> None:
        line = json.dumps({"rank": self.rank, "step": self.step, "time": round(now, 6), **metrics},
                          default=plain)
        try:
            if self._metrics_file is None:
                self._metrics_file = open(files.metrics_file(self.run_dir), "a", buffering=1 << 16)  # noqa: SIM115
            self._metrics_file.write(line + "\n")
        except OSError:
            pass

    def publish(self, now: float | None = None) -> None:
        """Write this rank's latest state now (atomically)."""
        now = time.time() if now is None else now
        self._last_publish = now
        if self._metrics_file is not None:
            try:
                self._metrics_file.flush()
            except OSError:
                pass
        state = {"rank": self.rank, "step": self.step, "total": self.total, "time": now,
                 "metrics": self.metrics, "pid": os.getpid()}
        with self._lock:
            publish_state(self.run_dir, self.rank, state)

    def close(self, status: str = "ok") -> None:
        """Publish the last state, close ``metrics.jsonl``, then the trackers with how the attempt ended
        (``ok``, ``interrupted``, ``failed``). Closing twice does nothing more."""
        if self.step is not None:
            self.publish()
        if self._metrics_file is not None:
            try:
                self._metrics_file.close()
            except OSError:
                pass
            self._metrics_file = None
        if self.sink is not None:
            sink, self.sink = self.sink, None
            sink.close(status)
