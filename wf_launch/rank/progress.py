"""``ctx.progress(step, total, **metrics)`` on a rank: never a collective, a few microseconds per
call.

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

__all__ = ["PUBLISH_ENV", "RESERVED_METRICS", "STEPS_ENV", "ProgressReporter", "publish_interval"]

RESERVED_METRICS = frozenset({"rank", "step", "time"})
"""The columns every line of the metrics file has; a metric may not take their names."""

PUBLISH_ENV = "WF_PROGRESS_PUBLISH_S"
"""Seconds between a rank's progress publications (default 0.5); the drill sets 0: every step is
seen."""
STEPS_ENV = "WF_PROGRESS_LOG_STEPS"
"""When ``1``, every ``ctx.progress`` call appends its line to the run's metrics file, with metrics
or
without: the layout tuner times steps from those lines."""


def publish_interval(default: float = 0.5) -> float:
    """:data:`PUBLISH_ENV` if set to seconds >= 0, else ``default``."""
    try:
        value = float(os.environ.get(PUBLISH_ENV, default))
    except ValueError:
        return default
    return value if 0 <= value < float("inf") else default


class ProgressReporter:
    """One rank's progress: cheap to call at every step."""

    def __init__(
        self,
        run_dir: Path | str,
        rank: int,
        publish_s: float = 0.5,
        max_metrics_bytes: int = 0,
        warn: Any = None,
        sink: Any = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        # the rank's experiment trackers (a TrackerHub: ``log(step, metrics)``, ``close(status)``)
        self.sink = sink
        self.rank = rank
        self.publish_s = publish_s
        self.max_metrics_bytes = max_metrics_bytes
        self.capped = False
        self._warn = warn
        self.step: int | None = None
        self.total: int | None = None
        self.metrics: dict[str, Any] = {}
        self._last_publish = -math.inf
        self._metrics_file: Any = None
        self._lock = threading.Lock()
        self.log_steps = os.environ.get(STEPS_ENV) == "1"

    def __call__(self, step: int, total: int | None = None, **metrics: Any) -> None:
        if metrics and not RESERVED_METRICS.isdisjoint(metrics):
            name = sorted(RESERVED_METRICS.intersection(metrics))[0]
            raise ValueError(
                f"ctx.progress(..., {name}=...): {name!r} is a reserved name: every "
                f"{files.METRICS} line "
                f"has the columns {sorted(RESERVED_METRICS)}, set by the reporter; give the metric "
                f"another name (e.g. {name}_value)"
            )
        now = time.time()
        self.step = int(step)
        if total is not None:
            self.total = int(total)
        if metrics:
            self.metrics = metrics
        if metrics or self.log_steps:
            self._append(now, metrics)
        if metrics and self.sink is not None:
            self.sink.log(self.step, metrics)
        if now - self._last_publish >= self.publish_s or (
            self.total is not None and self.step >= self.total
        ):
            self.publish(now)

    def _append(self, now: float, metrics: dict[str, Any]) -> None:
        if self.capped:
            return
        line = json.dumps(
            {"rank": self.rank, "step": self.step, "time": round(now, 6), **metrics}, default=plain
        )
        try:
            if self._metrics_file is None:
                path = files.metrics_file(self.run_dir)
                self._metrics_file = open(path, "a", buffering=1 << 16)  # noqa: SIM115
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
                self._check_cap(os.fstat(self._metrics_file.fileno()).st_size)
            except OSError:
                pass
        state = {
            "rank": self.rank,
            "step": self.step,
            "total": self.total,
            "time": now,
            "metrics": self.metrics,
            "pid": os.getpid(),
        }
        with self._lock:
            publish_state(self.run_dir, self.rank, state)

    def _check_cap(self, size: int) -> None:
        """Stop appending metrics once ``metrics.jsonl`` holds ``max_metrics_bytes``
        (``launcher.max_metrics_mb``)."""
        if self.capped or not self.max_metrics_bytes or size < self.max_metrics_bytes:
            return
        self.capped = True
        if self._warn is not None:
            self._warn(
                f"{files.metrics_file(self.run_dir)} reached launcher.max_metrics_mb "
                f"({self.max_metrics_bytes / 2**20:g} MB): rank {self.rank} writes no more "
                "metrics to it "
                "(its progress is still published)"
            )

    def close(self, status: str = "ok") -> None:
        """Publish the last state, close ``metrics.jsonl``, then the trackers with how the attempt
        ended (``ok``, ``interrupted``, ``failed``). Closing twice does nothing more."""
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
