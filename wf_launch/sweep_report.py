"""Sweep report: one row per multirun point, as CSV, Markdown and a bar chart.

Hydra calls :class:`SweepReport` (registered in ``wf_launch/conf/config.yaml`` under
``hydra.callbacks.sweep_report``) when a ``-m`` sweep ends; ``python -m
wf_launch.sweep_report SWEEP_DIR [--metric M]`` rebuilds the same files later
from the job directories alone. The reader (:func:`collect_points`) and the
writer (:func:`write_report`) are shared with other launchers' status commands.

What a point is: an immediate sub-directory of the sweep directory holding
``.hydra/`` or ``result.json`` (Hydra's ``subdir: ${hydra.job.num}``). Points
Hydra planned (from ``multirun.yaml``) that have no directory yet are listed as
``not_run``.

Metric rule: a point's metrics are the top-level numeric fields (int or float,
not bool) of the per-rank results in ``result.json``; each field is taken from
the lowest-numbered rank that reports it, since the rank holding a run's
summary (rank 0, or the rank that holds the output) reports it once. Identity
fields (:data:`IDENTITY_FIELDS`) are skipped. ``wall_s`` (launch to the last
rank's exit, from ``timings.wall_s``) is always available as a metric.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from worldfoundry.core.distributed.topology import DIMS

from . import rundir
from .record import RecordError, RunRecord, Status

__all__ = ["BASE_COLUMNS", "DEFAULT_METRIC", "FAILED_STATUSES", "IDENTITY_FIELDS", "PLAN_FILE", "SweepReport", "collect_points", "failure_text", "main", "metric_names", "metric_value", "planned_points", "point_metrics", "render_chart", "render_csv", "render_markdown", "sweep_exit_code", "write_report"]

IDENTITY_FIELDS = frozenset({"rank", "local_rank", "world_size", "stage", "node_rank"})
DEFAULT_METRIC = "tokens_per_s"
CSV_NAME, MD_NAME, CHART_NAME = "sweep_summary.csv", "sweep_summary.md", "sweep_chart.png"
SCALING_NAME, STEPS_NAME = "sweep_scaling.png", "sweep_steps.png"
PLAN_FILE = "multirun.yaml"
NOT_RUN, INCOMPLETE, UNREADABLE = "not_run", "incomplete", "unreadable"
"""Report-only statuses: planned but never started; started, no record yet; a record that cannot be read."""
BASE_COLUMNS = ("job", "status", "overrides", *DIMS, "world", "wall_s")
FAILED_STATUSES = frozenset({*(str(s) for s in Status if s.is_failure and s is not Status.INVALID), UNREADABLE})


def _load_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except (FileNotFoundError, yaml.YAMLError):
        return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def point_metrics(result: dict[str, Any]) -> dict[str, float | int]:
    """Numeric top-level fields of the per-rank results, each from the lowest rank reporting it."""
    metrics: dict[str, float | int] = {}
    ranks = result.get("results") or {}
    for key in sorted(ranks, key=lambda r: int(r) if str(r).lstrip("-").isdigit() else math.inf):
        row = ranks[key]
        if not isinstance(row, dict):
            continue
        for name, value in row.items():
            if name not in metrics and name not in IDENTITY_FIELDS and _is_number(value):
                metrics[name] = value
    return metrics


def _layout(result: dict[str, Any], job_dir: Path) -> dict[str, Any]:
    """tp/cp/pp/dp/world from the result, else as requested in the job's composed config."""
    lay = result.get("layout")
    if isinstance(lay, dict) and all(d in lay for d in DIMS):
        return {**{d: lay[d] for d in DIMS}, "world": lay.get("world_size")}
    engine = (_load_yaml(job_dir / ".hydra" / "config.yaml") or {}).get("engine") or {}
    sizes = {d: engine.get(f"{d}_size") for d in DIMS}
    world = math.prod(sizes.values()) if all(_is_number(v) for v in sizes.values()) else None
    return {**sizes, "world": world}


def failure_text(result: dict[str, Any]) -> str:
    """One line: which rank failed first and with what (empty for a point that did not fail)."""
    failure = result.get("failure")
    if not isinstance(failure, dict):
        return ""
    message = str(failure.get("message") or "").strip().splitlines()
    text = message[0] if message else str(failure.get("cause") or "")
    if failure.get("type") and failure["type"] not in text:
        text = f"{failure['type']}: {text}"
    rank = failure.get("rank")
    if isinstance(rank, int) and rank >= 0:
        coords = failure.get("coords") or {}
        where = " ".join(f"{d}{coords[d]}" for d in DIMS if d in coords)
        text = f"rank {rank}{f' ({where})' if where else ''}: {text}"
    return text


def _job_num(job_dir: Path) -> int | None:
    if job_dir.name.isdigit():
        return int(job_dir.name)
    hydra_cfg = (_load_yaml(job_dir / ".hydra" / "hydra.yaml") or {}).get("hydra") or {}
    num = (hydra_cfg.get("job") or {}).get("num")
    return num if isinstance(num, int) else None


def expand_sweep(overrides: list[Any]) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper expands parsed ``overrides``: the cartesian
    product of every key's values (a later override of a key replaces an earlier one, keeping its
    place), in order. Only discrete sweeps (``a=1,2``, ``choice``, ``range``); others raise ValueError.
    """
    axes: dict[str, list[str]] = {}
    for override in overrides:
        key = override.get_key_element()
        if override.is_sweep_override():
            if not override.is_discrete_sweep():
                raise ValueError(f"cannot expand the sweep {key} offline (not a discrete sweep)")
            axes[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            axes[key] = [f"{key}={override.get_value_element_as_str()}"]
    return [list(job) for job in itertools.product(*axes.values())]


def planned_points(sweep_dir: Path | str) -> list[list[str]]:
    """Each job's overrides, in job-number order, as Hydra's basic sweeper expands ``multirun.yaml``.

    Empty when there is no ``multirun.yaml`` or its sweep cannot be expanded offline.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    cfg = _load_yaml(Path(sweep_dir) / PLAN_FILE) or {}
    hydra_cfg = cfg.get("hydra") or {}
    params = (hydra_cfg.get("sweeper") or {}).get("params") or {}
    args = [f"{k}={v}" for k, v in params.items()] + list((hydra_cfg.get("overrides") or {}).get("task") or [])
    try:
        return expand_sweep(OverridesParser.create().parse_overrides(args))
    except Exception:
        return []


def _point(job_dir: Path) -> dict[str, Any]:
    try:
        record = RunRecord.read(job_dir)
    except RecordError as exc:
        return {"job": _job_num(job_dir), "status": UNREADABLE,
                "overrides": " ".join(str(o) for o in _load_yaml(job_dir / ".hydra" / "overrides.yaml") or []),
                **_layout({}, job_dir), "wall_s": None, "failure": str(exc), "metrics": {}, "dir": str(job_dir)}
    result = record.to_json() if record is not None else {}
    overrides = result.get("overrides")
    if overrides is None:
        overrides = _load_yaml(job_dir / ".hydra" / "overrides.yaml") or []
    wall = (result.get("timings") or {}).get("wall_s")
    return {
        "job": _job_num(job_dir), "status": result.get("status") or INCOMPLETE,
        "overrides": " ".join(str(o) for o in overrides), **_layout(result, job_dir),
        "wall_s": wall if _is_number(wall) else None,
        "failure": failure_text(result) if result.get("status") != "ok" else "",
        "metrics": point_metrics(result), "dir": str(job_dir),
    }


def collect_points(sweep_dir: Path | str) -> list[dict[str, Any]]:
    """Every point of the sweep at ``sweep_dir``, in job order, read from its job directory.

    Each point is a dict: job, status, overrides (one string), tp/cp/pp/dp/world,
    wall_s, failure (one line, empty unless the point did not succeed), metrics
    (name -> number, see the module's metric rule) and dir. A job directory
    without ``result.json`` is ``incomplete`` (running, or its launcher died); a
    planned job with no directory is ``not_run``.
    """
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"sweep directory {str(sweep_dir)!r} does not exist")
    points = [_point(d) for d in sorted(sweep_dir.iterdir())
              if d.is_dir() and not d.name.startswith(".")
              and ((d / ".hydra").is_dir() or RunRecord.path(d).is_file())]
    seen = {p["job"] for p in points}
    for num, overrides in enumerate(planned_points(sweep_dir)):
        if num not in seen:
            points.append({"job": num, "status": NOT_RUN, "overrides": " ".join(overrides),
                           **{d: None for d in DIMS}, "world": None, "wall_s": None, "failure": "",
                           "metrics": {}, "dir": ""})
    return sorted(points, key=lambda p: (p["job"] is None, p["job"] if p["job"] is not None else 0, p["dir"]))


def metric_value(point: dict[str, Any], metric: str) -> float | int | None:
    """``metric`` of ``point`` (``wall_s`` included), or None where it did not report one."""
    if metric == "wall_s":
        return point.get("wall_s")
    return point.get("metrics", {}).get(metric)


def metric_names(points: list[dict[str, Any]], first: str | None = None) -> list[str]:
    """Every metric any point reports, in first-seen order, ``first`` leading if reported."""
    names: list[str] = []
    for p in points:
        names += [m for m in p.get("metrics", {}) if m not in names]
    if first in names:
        names.remove(first)
        names.insert(0, first)
    return names


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if not math.isfinite(value) or value == 0:
            return str(value) if value else "0"
        if abs(value) >= 1000:
            return f"{value:.0f}"
        if abs(value) >= 0.01:
            return f"{value:.3f}".rstrip("0").rstrip(".")
        return f"{value:.3g}"
    return str(value)


def _split_overrides(points: list[dict[str, Any]]) -> tuple[list[str], set[str]]:
    """Overrides every point shares (in order), and the keys whose values differ between points."""
    per_point = [p["overrides"].split() for p in points if p["overrides"]]
    common = [o for o in per_point[0] if all(o in other for other in per_point)] if per_point else []
    keys = {o.split("=", 1)[0] for ovs in per_point for o in ovs if o not in common}
    return common, keys


def render_csv(points: list[dict[str, Any]], metric: str) -> str:
    """The summary as CSV: base columns, every metric (full precision), failure."""
    names = metric_names(points, metric)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*BASE_COLUMNS, *names, "failure"])
    for p in points:
        writer.writerow([*("" if p.get(c) is None else p[c] for c in BASE_COLUMNS),
                         *("" if p["metrics"].get(m) is None else p["metrics"][m] for m in names),
                         p["failure"]])
    return out.getvalue()


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(points: list[dict[str, Any]], metric: str, sweep_dir: Path | str) -> str:
    """The summary as a Markdown table, with a count per status and the failures listed."""
    names = metric_names(points, metric)
    counts: dict[str, int] = {}
    for p in points:
        counts[p["status"]] = counts.get(p["status"], 0) + 1
    lines = [f"# Sweep summary: {Path(sweep_dir).name}", "",
             f"{len(points)} point(s): " + ", ".join(f"{n} {s}" for s, n in counts.items())
             + f". Chart metric: `{metric}`.", ""]
    common, _ = _split_overrides(points)
    if common:
        lines += ["Every point: `" + " ".join(common) + "`", ""]
    header = ["job", "status", "overrides", "layout (tp/cp/pp/dp)", "world", "wall_s", *names]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for p in points:
        layout = "/".join(_fmt(p[d]) if p[d] is not None else "?" for d in DIMS)
        status = p["status"] if p["status"] == "ok" else f"**{p['status']}**"
        own = " ".join(o for o in p["overrides"].split() if o not in common)
        row = [_fmt(p["job"]), status, f"`{own}`" if own else "", layout,
               _fmt(p["world"]), _fmt(p["wall_s"]), *(_fmt(p["metrics"].get(m)) for m in names)]
        lines.append("| " + " | ".join(_md_cell(c) for c in row) + " |")
    failures = [p for p in points if p["failure"]]
    if failures:
        lines += ["", "## Points that did not succeed", ""]
        lines += [f"- job {_fmt(p['job'])} ({p['status']}): {p['failure']}" for p in failures]
    return "\n".join(lines) + "\n"


def _label(point: dict[str, Any], dims: list[str], varying: list[str]) -> str:
    sizes = "·".join(f"{d}{'?' if point[d] is None else point[d]}" for d in dims)
    world = point["world"]
    lines = [f"#{_fmt(point['job'])} {sizes}".rstrip(), f"{'?' if world is None else world} rank(s)"]
    return "\n".join(lines + [o for o in point["overrides"].split() if o.split("=", 1)[0] in varying])


def render_chart(points: list[dict[str, Any]], metric: str, path: Path | str) -> str:
    """Bar chart of ``metric`` per point at ``path``; points without a value are marked by status.

    Returns the metric actually drawn: ``wall_s`` when no point reports ``metric``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = metric if any(metric_value(p, metric) is not None for p in points) else "wall_s"
    _, keys = _split_overrides(points)
    varying = [k for k in keys if not k.lstrip("+~").startswith("engine.")]
    dims = [d for d in DIMS if len({p[d] for p in points}) > 1]
    values = [metric_value(p, drawn) for p in points]
    top = max([v for v in values if v is not None and math.isfinite(v)] or [1.0]) or 1.0
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(points) + 2), 4.6), dpi=110)
    for i, (p, v) in enumerate(zip(points, values)):
        ok = p["status"] == "ok"
        if v is not None and math.isfinite(v):
            ax.bar(i, v, color="#4C72B0" if ok else "#C44E52", edgecolor="black", linewidth=0.6,
                   hatch=None if ok else "//")
            ax.text(i, v + top * 0.01, _fmt(v) if ok else f"{_fmt(v)}\n{p['status']}", ha="center",
                    va="bottom", fontsize=8)
        else:
            ax.bar(i, top * 0.06, color="white", edgecolor="#C44E52" if not ok else "grey", hatch="xx",
                   linewidth=1.0)
            ax.text(i, top * 0.08, p["status"].upper() if not ok else "n/a", ha="center", va="bottom",
                    fontsize=8, color="#C44E52" if not ok else "grey", fontweight="bold", rotation=90)
    ax.set_xticks(range(len(points)), [_label(p, dims, varying) for p in points], fontsize=8)
    ax.set_ylabel(drawn)
    ax.set_ylim(0, top * 1.2)
    title = f"{drawn} per layout"
    if drawn != metric:
        title += f" (no point reported {metric!r})"
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    _save(fig, Path(path))
    return drawn


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        Path(tmp).unlink(missing_ok=True)


def render_scaling_chart(points: list[dict[str, Any]], metric: str, path: Path | str) -> bool:
    """Throughput against world size, with ideal linear scaling from the smallest world; False if the
    sweep does not vary the world size or no ok point reports ``metric``."""
    ok = [p for p in points if p["status"] == "ok" and isinstance(p.get("world"), int)
          and metric_value(p, metric) is not None]
    worlds = sorted({p["world"] for p in ok})
    if len(worlds) < 2:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = {w: max(metric_value(p, metric) for p in ok if p["world"] == w) for w in worlds}
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=110)
    for p in ok:
        ax.scatter(p["world"], metric_value(p, metric), color="#4C72B0", alpha=0.45, s=18)
    ax.plot(worlds, [best[w] for w in worlds], "o-", color="#4C72B0", label=f"{metric} (best layout per size)")
    base = worlds[0]
    ax.plot(worlds, [best[base] * w / base for w in worlds], "--", color="grey",
            label=f"ideal linear scaling from {base} rank(s)")
    ax.set(xscale="log", xlabel="ranks (world size)", ylabel=metric, title=f"{metric} against world size")
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, Path(path))
    return True


def render_steps_chart(points: list[dict[str, Any]], path: Path | str, metric: str | None = None) -> str | None:
    """One metric over steps (from each point's ``metrics.jsonl``), one line per point; the metric drawn,
    or None when no point reported progress metrics."""
    from .plot import load_metrics

    series = {p["job"]: load_metrics(p["dir"]) for p in points if p.get("dir")}
    names = [n for s in series.values() for n in s]
    if not names:
        return None
    drawn = metric if metric in names else ("loss" if "loss" in names else names[0])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.4), dpi=110)
    for p in points:
        by_rank = series.get(p["job"], {}).get(drawn)
        if by_rank:
            steps = sorted(by_rank[min(by_rank)])
            ax.plot([s for s, _ in steps], [v for _, v in steps], lw=1.3,
                    label=f"job {p['job']}: {p['overrides'] or 'defaults'}"[:60])
    ax.set(xlabel="step", ylabel=drawn, title=f"{drawn} over steps, one line per point")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, Path(path))
    return drawn


def write_report(sweep_dir: Path | str, points: list[dict[str, Any]], metric: str = DEFAULT_METRIC,
                 chart: bool = True) -> dict[str, Path]:
    """Write ``sweep_summary.csv``, ``sweep_summary.md`` and (``chart``) ``sweep_chart.png`` atomically.

    Without matplotlib the chart is skipped with a note on stderr. Returns the paths written.
    """
    sweep_dir = Path(sweep_dir)
    written = {"csv": sweep_dir / CSV_NAME, "md": sweep_dir / MD_NAME}
    rundir.atomic_write_text(written["csv"], render_csv(points, metric))
    rundir.atomic_write_text(written["md"], render_markdown(points, metric, sweep_dir))
    if chart and points:
        try:
            render_chart(points, metric, sweep_dir / CHART_NAME)
            written["png"] = sweep_dir / CHART_NAME
            if render_scaling_chart(points, metric, sweep_dir / SCALING_NAME):
                written["scaling"] = sweep_dir / SCALING_NAME
            if render_steps_chart(points, sweep_dir / STEPS_NAME):
                written["steps"] = sweep_dir / STEPS_NAME
        except ImportError:
            print("wf_launch: sweep chart skipped: matplotlib is not installed "
                  "(pip install matplotlib)", file=sys.stderr)
    return written


def sweep_exit_code(points: list[dict[str, Any]]) -> int:
    """1 if any point failed or was interrupted, else 2 if any was invalid, else 0."""
    statuses = {p["status"] for p in points}
    if statuses & FAILED_STATUSES:
        return 1
    return 2 if Status.INVALID in statuses else 0


def _status_line(points: list[dict[str, Any]], written: dict[str, Path]) -> str:
    counts: dict[str, int] = {}
    for p in points:
        counts[p["status"]] = counts.get(p["status"], 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    return f"wf_launch: sweep report ({summary}): {written['md']}"


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra is a dependency; keep the offline reader importable
    _HydraCallback = object  # type: ignore[assignment,misc]


class SweepReport(_HydraCallback):  # type: ignore[misc,valid-type]
    """Hydra callback: keep every point's failure in the report, write the report, set the exit code.

    ``metric``: the charted metric. ``exit_nonzero``: leave the sweep with
    :func:`sweep_exit_code` once the report is written. A point whose launch
    raised is recorded as 'failed' in its ``result.json`` and the sweep goes on
    (Hydra would otherwise abort before reporting). An interrupted point stops the
    sweep: the report is written (remaining points ``not_run``) and the process
    leaves with the point's exit code (128 + signal).
    """

    def __init__(self, metric: str = DEFAULT_METRIC, exit_nonzero: bool = True, chart: bool = True) -> None:
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"hydra.callbacks.sweep_report.metric={metric!r} is not allowed: "
                             "expected the name of a numeric result field, e.g. tokens_per_s or wall_s")
        self.metric = metric
        self.exit_nonzero = bool(exit_nonzero)
        self.chart = bool(chart)
        self._sweep_dir: Path | None = None

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        """A sweep directory holds one sweep: refuse one that holds points already (exit 2).

        With ``launcher.overwrite=true`` the earlier sweep is moved aside into a
        sibling ``NAME.replaced-TIMESTAMP`` directory first, so its points never
        mix into this sweep's report.
        """
        from omegaconf import OmegaConf

        sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        old = sorted(d.name for d in sweep_dir.iterdir()
                     if d.is_dir() and any((d / m).exists() for m in rundir.MARKERS)) if sweep_dir.is_dir() else []
        if old and OmegaConf.select(config, "launcher.overwrite", default=False) is not True:
            print(f"wf_launch: sweep directory {sweep_dir} already holds a sweep (points {', '.join(old[:8])}"
                  f"{' ...' if len(old) > 8 else ''}); choose another hydra.sweep.dir, or pass "
                  "launcher.overwrite=true to move that sweep aside", file=sys.stderr, flush=True)
            raise SystemExit(2)
        if old:
            aside = sweep_dir.with_name(f"{sweep_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
            sweep_dir.rename(aside)
            sweep_dir.mkdir()
        self._sweep_dir = sweep_dir

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        if self._sweep_dir is None:
            return
        job_dir = Path(str(config.hydra.runtime.output_dir))
        if job_return.status == JobStatus.FAILED:
            self._record_launch_error(job_dir, job_return)
            return
        outcome = job_return.return_value
        if getattr(outcome, "status", None) == Status.INTERRUPTED:
            self.report()
            raise SystemExit(int(getattr(outcome, "exit_code", 130)) or 130)

    def _record_launch_error(self, job_dir: Path, job_return: Any) -> None:
        """The launch itself raised: record it as a failed point and let the sweep go on."""
        import traceback

        from hydra.core.utils import JobStatus

        from .outcome import RunOutcome

        try:
            job_return.return_value  # noqa: B018 - re-raises what the launch raised
            return
        except BaseException as raised:
            exc = raised
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        message = f"launcher error: {type(exc).__name__}: {exc}"
        RunRecord.finalize(job_dir, Status.FAILED, overrides=list(job_return.overrides or []), run_dir=str(job_dir),
                           failure={"cause": "launcher_error", "type": type(exc).__name__, "message": str(exc)})
        print(f"wf_launch: {message}", file=sys.stderr, flush=True)
        job_return.status = JobStatus.COMPLETED
        job_return.return_value = RunOutcome(Status.FAILED, job_dir, message)

    def report(self) -> list[dict[str, Any]]:
        """Write the report for this sweep; returns its points."""
        assert self._sweep_dir is not None
        points = collect_points(self._sweep_dir)
        written = write_report(self._sweep_dir, points, self.metric, chart=self.chart)
        print(_status_line(points, written), file=sys.stderr, flush=True)
        return points

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if self._sweep_dir is None:
            return
        try:
            code = sweep_exit_code(self.report())
        except Exception as exc:
            print(f"wf_launch: writing the sweep report in {self._sweep_dir} failed: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            code = 1
        if code and self.exit_nonzero:
            raise SystemExit(code)


def main(argv: list[str] | None = None) -> int:
    """``python -m wf_launch.sweep_report SWEEP_DIR [--metric M]``: rebuild the report from the job dirs."""
    ap = argparse.ArgumentParser(prog="python -m wf_launch.sweep_report", description=main.__doc__)
    ap.add_argument("sweep_dir", type=Path, help="the multirun directory (hydra.sweep.dir)")
    ap.add_argument("--metric", default=DEFAULT_METRIC, help=f"metric to chart (default {DEFAULT_METRIC}; "
                    "any numeric result field, or wall_s)")
    ap.add_argument("--no-chart", action="store_true", help="write only the CSV and Markdown")
    ap.add_argument("--json", action="store_true", help="also print the points as JSON on stdout")
    args = ap.parse_args(argv)
    try:
        points = collect_points(args.sweep_dir)
    except FileNotFoundError as exc:
        print(f"wf_launch.sweep_report: {exc}", file=sys.stderr)
        return 2
    if not points:
        print(f"wf_launch.sweep_report: no job directories (with .hydra/ or result.json) in "
              f"{str(args.sweep_dir)!r}", file=sys.stderr)
        return 2
    written = write_report(args.sweep_dir, points, args.metric, chart=not args.no_chart)
    if args.json:
        print(json.dumps(points, indent=2, default=str))
    print(_status_line(points, written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
