"""The trackers of one rank, fed from ``ctx.progress`` and run on a thread of their own.

The training loop only queues points (``log`` costs a dict filter and a queue put). The hub's
thread opens each tracker (imports, connections, the config as hyper-parameters), writes the
points in batches every ``flush_s`` and flushes, then records in ``tracking/NAME.json`` the last
step each tracker holds. Continuing across attempts:

* a tracker never gets a step it already holds (:meth:`Tracker.open` returns the last one: read
  back from MLflow or W&B, or the step recorded after TensorBoard's last flush, past which
  TensorBoard purges), so a restart that repeats steps since its checkpoint neither duplicates
  nor rewinds a curve;
* the steps between what a tracker holds and where this attempt starts (points a killed attempt
  never got to its trackers) are replayed from ``metrics.jsonl``.

A tracker that raises is switched off with one warning and the run goes on; ``metrics.jsonl`` is
written before anything reaches the hub, so it always holds every metric.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worldfoundry.core.validation import is_number

from ...rundir import files
from ...rundir.io import atomic_write_json, read_json, read_lines
from ...rundir.progress import plain
from .base import Tracker

__all__ = ["MAX_BACKLOG", "TrackerHub", "numeric_metrics"]

MAX_BACKLOG = 200_000
"""Points queued for the trackers before new ones are dropped (a tracker stuck on a dead server)."""
_RESERVED = ("rank", "step", "time")


@dataclass(frozen=True)
class _Close:
    status: str


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics a tracker can draw: numbers (tensors and numpy scalars as their value), bools
    left out."""
    out = {}
    for key, value in metrics.items():
        value = plain(value) if not isinstance(value, (int, float, str)) else value
        if is_number(value) and key not in _RESERVED:
            out[str(key)] = float(value)
    return out


def _merge(points: Iterable[tuple[int, dict[str, float]]]) -> list[tuple[int, dict[str, float]]]:
    """Consecutive points of one step as one (``ctx.progress(5, loss=...)`` then ``ctx.progress(5,
    acc=...)``)."""
    out: list[tuple[int, dict[str, float]]] = []
    for step, values in points:
        if out and out[-1][0] == step:
            out[-1][1].update(values)
        else:
            out.append((step, dict(values)))
    return out


class TrackerHub:
    """Queues one rank's points and writes them to its trackers from a daemon thread (see the
    module)."""

    def __init__(
        self,
        trackers: list[Tracker],
        run_dir: Path | str,
        rank: int,
        log: Any,
        flush_s: float = 1.0,
        close_timeout_s: float = 30.0,
    ) -> None:
        self.run_dir, self.rank, self._logger = Path(run_dir), rank, log
        self.flush_s, self.close_timeout_s = flush_s, close_timeout_s
        self._trackers = list(trackers)
        self._held: dict[str, int | None] = {}
        self._logged: dict[str, int | None] = {}
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._dropped = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="wf-trackers", daemon=True)
        self._thread.start()

    @property
    def trackers(self) -> list[str]:
        """The names of the trackers still writing."""
        return [t.name for t in self._trackers]

    # ------------------------------------------------------------------ the training thread
    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Queue one point (never blocks, never raises into the task)."""
        try:
            values = numeric_metrics(metrics)
            if not values or self._closed:
                return
            if self._queue.qsize() >= MAX_BACKLOG:
                if not self._dropped:
                    self._dropped = True
                    self._logger.warning(
                        f"trackers {self.trackers} fall behind by {MAX_BACKLOG} points: dropping "
                        "new "
                        f"ones ({files.METRICS} keeps every metric)"
                    )
                return
            self._queue.put((int(step), values))
        except Exception:  # a tracker never fails the run
            pass

    def close(self, status: str) -> None:
        """Write what is queued, record ``status`` in every tracker, and wait for it
        (``close_timeout_s`` at most)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_Close(status))
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            self._logger.warning(
                f"trackers {self.trackers} still writing after tracking.close_timeout_s="
                f"{self.close_timeout_s:g} s; leaving them ({files.METRICS} keeps every metric)"
            )

    # ------------------------------------------------------------------ the hub's thread
    def _run(self) -> None:
        for tracker in list(self._trackers):
            self._call(tracker, "open", lambda t=tracker: self._opened(t, t.open()))
        first: int | None = None
        batch: list[tuple[int, dict[str, float]]] = []
        deadline = time.monotonic() + self.flush_s
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                item = None
            if isinstance(item, _Close):
                if first is None:
                    self._replay(None)
                self._write(batch)
                self._finish(item.status)
                return
            if item is not None:
                if first is None:
                    first = item[0]
                    self._replay(first)
                batch.append(item)
            if time.monotonic() >= deadline:
                batch = self._write_all_but_the_newest_step(batch)
                deadline = time.monotonic() + self.flush_s

    def _write_all_but_the_newest_step(
        self, batch: list[tuple[int, dict[str, float]]]
    ) -> list[tuple[int, dict[str, float]]]:
        """Write the batch but its newest step, which may still get metrics (``ctx.progress(7,
        loss=...)`` then ``ctx.progress(7, acc=...)``); return that step's points, to go with the
        next batch. A step is written once, as one point, however the flushes fall."""
        cut = len(batch)
        while cut and batch[cut - 1][0] == batch[-1][0]:
            cut -= 1
        self._write(batch[:cut])
        return batch[cut:]

    def _opened(self, tracker: Tracker, held: int | None) -> None:
        self._held[tracker.name] = held
        self._logged[tracker.name] = None
        self._save_state(tracker, status="running")

    def _replay(self, before: int | None) -> None:
        """Points of this rank in ``metrics.jsonl`` that a tracker lacks, up to (not including) step
        ``before``."""
        floors = [h for t in self._trackers if (h := self._held.get(t.name)) is not None]
        if not self._trackers:
            return
        floor = min(floors) if len(floors) == len(self._trackers) else -math.inf
        points = _read_metrics(self.run_dir, self.rank, floor, before)
        if points:
            self._logger.debug(
                f"trackers: replaying {len(points)} step(s) from {files.METRICS} "
                f"({points[0][0]}..{points[-1][0]}) that an earlier attempt did not hand over"
            )
            self._write(points)

    def _write(self, batch: list[tuple[int, dict[str, float]]]) -> None:
        if not batch:
            return
        points = _merge(batch)
        for tracker in list(self._trackers):
            held, logged = self._held.get(tracker.name), self._logged.get(tracker.name)
            fresh = [
                (s, v)
                for s, v in points
                if (held is None or s > held) and (logged is None or s >= logged)
            ]
            if fresh and self._call(
                tracker, "log", lambda t=tracker, f=fresh: (t.log(f), t.flush())
            ):
                self._logged[tracker.name] = fresh[-1][0]
                self._save_state(tracker, status="running")

    def _finish(self, status: str) -> None:
        for tracker in list(self._trackers):
            if self._call(tracker, "close", lambda t=tracker: t.close(status)):
                self._save_state(tracker, status=status)

    def _call(self, tracker: Tracker, what: str, fn: Any) -> bool:
        """Run ``fn``; a tracker that raises is switched off with one warning (the run goes on)."""
        try:
            fn()
            return True
        except Exception as exc:
            if tracker in self._trackers:
                self._trackers.remove(tracker)
            self._logger.warning(
                f"tracker {tracker.name} failed to {what} ({type(exc).__name__}: "
                f"{str(exc).strip()[:300]}); it is off for the rest of this attempt, the run goes "
                "on "
                f"({files.METRICS} keeps every metric)"
            )
            return False

    def _save_state(self, tracker: Tracker, status: str) -> None:
        path = files.tracker_state(self.run_dir, tracker.name, self.rank)
        last = max(
            (
                s
                for s in (self._held.get(tracker.name), self._logged.get(tracker.name))
                if s is not None
            ),
            default=None,
        )
        state = {
            "tracker": tracker.name,
            "rank": self.rank,
            "last_step": last,
            "run": tracker.run_ref(),
            "status": status,
            "attempt": tracker.settings.attempt,
            "time": time.time(),
        }
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, state)
        except OSError as exc:
            self._logger.debug(f"tracker {tracker.name}: cannot record its state in {path}: {exc}")


def read_state(run_dir: Path | str, tracker: str, rank: int) -> dict[str, Any]:
    """A tracker's state from earlier attempts (``{}`` when it has none, or it is unreadable)."""
    try:
        data = read_json(files.tracker_state(run_dir, tracker, rank))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_metrics(
    run_dir: Path, rank: int, floor: float, before: int | None
) -> list[tuple[int, dict[str, float]]]:
    """This rank's points in ``metrics.jsonl`` with ``floor < step < before``, by step (the last
    value of a step reported twice wins), streamed line by line."""
    by_step: dict[int, dict[str, float]] = {}
    try:
        for line in read_lines(files.metrics_file(run_dir)):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if not isinstance(row, dict) or row.get("rank") != rank:
                continue
            step = row.get("step")
            if type(step) is not int or step <= floor or (before is not None and step >= before):
                continue
            by_step.setdefault(step, {}).update(numeric_metrics(row))
    except (OSError, ValueError):
        return []
    return sorted((s, v) for s, v in by_step.items() if v)
