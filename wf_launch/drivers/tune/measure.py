"""Measuring a trial: its steady step time from ``ctx.progress`` timestamps, its metric, or why it
did not succeed.

Step times come from the trial's ``metrics.jsonl`` (the tuner asks every rank to log
every ``ctx.progress`` call there): a step ends when its slowest rank reports it;
the first ``warmup`` steps are dropped (start-up, allocation, first collectives),
and only the trial's last attempt counts. The metric is, in this order:

- ``step_time``: the median steady step time (lower is better);
- the metric reported with each step (``ctx.progress(step, total, tokens_per_s=...)``): its median;
- ``X_per_s`` when the task's result has ``X_per_step`` (``train``: ``tokens_per_step``): per step,
  ``X_per_step / step time``, then the median;
- the task's own result field (one number for the whole run; no spread).

Every measurement keeps its spread (the quartiles over the steady steps).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from worldfoundry.core.validation import is_number

from ...readers.sweep.points import failure_text, point_metrics
from ...rundir import attempts, files
from ...rundir.io import read_lines
from ...rundir.record import RecordError, RunRecord, Status

__all__ = [
    "STEP_TIME",
    "Measurement",
    "higher_is_better",
    "measure_point",
    "read_steps",
    "steady_durations",
]

STEP_TIME = "step_time"
OK, NO_METRIC, STALLED, OOM, FAILED = "ok", "no_metric", "stalled", "oom", "failed"
NOT_RUN, INCOMPLETE = "not_run", "incomplete"
_OOM_TYPES = ("OutOfMemoryError", "MemoryError")


def higher_is_better(metric: str) -> bool:
    """Throughput-like metrics win when larger; ``step_time`` when smaller."""
    return metric != STEP_TIME


@dataclass
class Measurement:
    """One trial of one round: how it ended, and what it measured."""

    trial: str
    round: int
    status: str
    cause: str = ""
    steps: int = 0
    measured: int = 0
    step_time: float | None = None
    value: float | None = None
    p25: float | None = None
    p75: float | None = None
    source: str = ""
    wall_s: float | None = None
    overhead_s: float | None = None
    run_dir: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK and self.value is not None

    @property
    def spread(self) -> float | None:
        """Half the interquartile range, relative to the value (0.03: ±3%)."""
        if self.value in (None, 0) or self.p25 is None or self.p75 is None:
            return None
        return abs(self.p75 - self.p25) / 2 / abs(self.value)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Measurement:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return median, q1, q3


def read_steps(run_dir: Path | str) -> dict[int, dict[str, Any]]:
    """step -> {"time": when its slowest rank reported it, metric: rank 0's value, ...}, last
    attempt only."""
    since = 0.0
    last = attempts.count(Path(run_dir)) - 1
    if last > 0:
        since = float((attempts.read(run_dir, last) or {}).get("started_at") or 0.0)
    steps: dict[int, dict[str, Any]] = {}
    try:
        lines = list(read_lines(files.metrics_file(run_dir)))
    except (OSError, ValueError):
        return {}
    for line in lines:
        try:
            row = json.loads(line)
            step, when, rank = int(row["step"]), float(row["time"]), int(row["rank"])
        except (ValueError, KeyError, TypeError):
            continue
        if when < since:
            continue
        entry = steps.setdefault(step, {"time": when})
        entry["time"] = max(entry["time"], when)
        if rank == 0:
            entry.update(
                {k: v for k, v in row.items() if k not in ("rank", "step", "time") and is_number(v)}
            )
    return steps


def steady_durations(steps: dict[int, dict[str, Any]], warmup: int) -> list[tuple[int, float]]:
    """(step, seconds) for every step after the first ``warmup`` whose previous step was also
    reported."""
    return [
        (s, steps[s]["time"] - steps[s - 1]["time"])
        for s in sorted(steps)
        if s > max(warmup, 1) and s - 1 in steps and steps[s]["time"] > steps[s - 1]["time"]
    ]


def _metric(
    metric: str,
    steps: dict[int, dict[str, Any]],
    durations: list[tuple[int, float]],
    results: dict[str, Any],
) -> tuple[list[float], str]:
    """The metric's per-step values (or the one value of the task's result) and where they came
    from."""
    if metric == STEP_TIME:
        return [d for _, d in durations], "steady step times"
    per_step = [steps[s][metric] for s, _ in durations if metric in steps[s]]
    if per_step:
        return per_step, f"{metric} reported with each step"
    work = (
        results.get(metric.removesuffix("_per_s") + "_per_step")
        if metric.endswith("_per_s")
        else None
    )
    if is_number(work) and durations:
        return [
            work / d for _, d in durations
        ], f"{metric.removesuffix('_per_s')}_per_step / steady step time"
    if is_number(results.get(metric)):
        return [float(results[metric])], f"the task's {metric} for the whole trial"
    return [], ""


def _failure(record: RunRecord, stalled: str | None) -> tuple[str, str]:
    """(status, cause) of a trial that did not succeed."""
    text = failure_text(record.to_json()) or str(record.status)
    if stalled:
        return STALLED, stalled
    failure = record.failure or {}
    if record.status is Status.FAILED:
        if (
            failure.get("type") in _OOM_TYPES
            or "out of memory" in str(failure.get("message", "")).lower()
        ):
            return OOM, text
        if failure.get("cause") == "signal" and failure.get("signal") == "SIGKILL":
            return (
                OOM,
                f"{text} (most likely the kernel's out-of-memory killer: the tuner did not send "
                "it)",
            )
        return FAILED, text
    return str(record.status), text


def _layout_mismatch(record: RunRecord, sizes: dict[str, int] | None) -> str:
    ran = {d: (record.layout or {}).get(d) for d in ("tp", "cp", "pp", "dp")}
    if sizes is None or record.layout is None or ran == sizes:
        return ""
    return (
        f"the trial ran {' '.join(f'{d}{n}' for d, n in ran.items())}, not its layout "
        f"{' '.join(f'{d}{n}' for d, n in sizes.items())} (its trial config was not applied)"
    )


def measure_point(
    run_dir: Path | str,
    trial: str,
    round_index: int,
    metric: str,
    warmup: int,
    steps: int,
    stalled: str | None = None,
    sizes: dict[str, int] | None = None,
) -> Measurement:
    """What the trial in ``run_dir`` measured, or why it did not (``stalled``: the tuner stopped it,
    and why; ``sizes``: the layout the trial must have run)."""
    base = Measurement(trial, round_index, NOT_RUN, steps=steps, run_dir=str(run_dir))
    if not Path(run_dir).is_dir():
        return base
    try:
        record = RunRecord.read(run_dir)
    except RecordError as exc:
        return Measurement(**{**asdict(base), "status": FAILED, "cause": str(exc)})
    if record is None:
        return Measurement(
            **{**asdict(base), "status": STALLED if stalled else INCOMPLETE, "cause": stalled or ""}
        )
    wall = record.timings.get("wall_s")
    base.wall_s = float(wall) if is_number(wall) else None
    if record.status is not Status.OK:
        base.status, base.cause = _failure(record, stalled)
        return base
    if mismatch := _layout_mismatch(record, sizes):
        base.status, base.cause = FAILED, mismatch
        return base
    table = read_steps(run_dir)
    durations = steady_durations(table, warmup)
    values, source = _metric(metric, table, durations, point_metrics(record.to_json()))
    base.measured = len(durations)
    if durations:
        base.step_time = _quartiles([d for _, d in durations])[0]
        if base.wall_s is not None:
            base.overhead_s = max(0.0, base.wall_s - steps * base.step_time)
    if not values:
        base.status, base.cause = (
            NO_METRIC,
            "no metric: " + _no_metric_reason(metric, table, len(durations)),
        )
        return base
    base.status, base.source = OK, source
    base.value, base.p25, base.p75 = _quartiles(values)
    return base


def _no_metric_reason(metric: str, table: dict[int, dict[str, Any]], timed: int) -> str:
    if not table:
        return (
            f"its ranks never called ctx.progress(step, total) and its result has no {metric!r}: "
            "the tuner "
            "times steps from ctx.progress (or reads the metric from the task's result)"
        )
    if not timed:
        return (
            f"it reported {len(table)} step(s), too few to time after the warm-up, and its result "
            "has no "
            f"{metric!r}"
        )
    work = f" nor {metric.removesuffix('_per_s')}_per_step" if metric.endswith("_per_s") else ""
    return (
        f"it reports steps (ctx.progress) but neither {metric!r} with each step, nor "
        f"{metric!r}{work} in its "
        f"result; --metric {STEP_TIME} tunes on step time alone"
    )
