"""A sweep's points, read from its job directories: status, layout, overrides, metrics, failure.

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

import itertools
import math
from pathlib import Path
from typing import Any

from worldfoundry.core.distributed.topology import DIMS
from worldfoundry.core.validation import is_int, is_number

from ...config.redact import redact_text
from ...rundir import files
from ...rundir.io import read_yaml
from ...rundir.record import RecordError, RunRecord, Status
from ...rundir.text import printable

__all__ = [
    "BASE_COLUMNS",
    "DEFAULT_METRIC",
    "FAILED_STATUSES",
    "IDENTITY_FIELDS",
    "INCOMPLETE",
    "NOT_RUN",
    "PLAN_FILE",
    "UNREADABLE",
    "collect_points",
    "expand_sweep",
    "failure_text",
    "metric_names",
    "metric_value",
    "planned_points",
    "point_metrics",
]

IDENTITY_FIELDS = frozenset({"rank", "local_rank", "world_size", "stage", "node_rank"})
DEFAULT_METRIC = "tokens_per_s"
PLAN_FILE = files.SWEEP_PLAN
NOT_RUN, INCOMPLETE, UNREADABLE = "not_run", "incomplete", "unreadable"
"""Report-only statuses: planned but never started; started, no record yet; a record that cannot be
read."""
BASE_COLUMNS = ("job", "status", "overrides", *DIMS, "world", "wall_s")
FAILED_STATUSES = frozenset(
    {*(str(s) for s in Status if s.is_failure and s is not Status.INVALID), UNREADABLE}
)


def _load_yaml(path: Path) -> Any:
    """The YAML at ``path``; None when it is missing or cannot be read (not a regular file, too big,
    malformed)."""
    try:
        return read_yaml(path)
    except (OSError, ValueError):
        return None


def _mapping(value: Any, key: str) -> dict[str, Any]:
    """``value[key]`` when both are mappings, else {} (a malformed file reads as empty, never a
    crash)."""
    found = value.get(key) if isinstance(value, dict) else None
    return found if isinstance(found, dict) else {}


def _rank_order(key: Any) -> float:
    text = str(key)
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 9 else math.inf


def point_metrics(result: dict[str, Any]) -> dict[str, float | int]:
    """Numeric top-level fields of the per-rank results, each from the lowest rank reporting it."""
    metrics: dict[str, float | int] = {}
    ranks = result.get("results") if isinstance(result.get("results"), dict) else {}
    for key in sorted(ranks, key=_rank_order):
        row = ranks[key]
        if not isinstance(row, dict):
            continue
        for name, value in row.items():
            if name not in metrics and name not in IDENTITY_FIELDS and is_number(value):
                metrics[name] = value
    return metrics


def _layout(result: dict[str, Any], job_dir: Path) -> dict[str, Any]:
    """tp/cp/pp/dp/world from the result, else as requested in the job's composed config."""
    lay = result.get("layout")
    if isinstance(lay, dict) and all(d in lay for d in DIMS):
        return {**{d: lay[d] for d in DIMS}, "world": lay.get("world_size")}
    engine = _mapping(_load_yaml(files.hydra_config(job_dir)), "engine")
    sizes = {d: engine.get(f"{d}_size") for d in DIMS}
    world = math.prod(sizes.values()) if all(is_number(v) for v in sizes.values()) else None
    return {**sizes, "world": world}


def failure_text(result: dict[str, Any]) -> str:
    """One line: which rank failed first and with what (empty for a point that did not fail)."""
    failure = result.get("failure")
    if not isinstance(failure, dict):
        return ""
    message = str(failure.get("message") or "").strip().splitlines()
    text = message[0] if message else str(failure.get("cause") or "")
    if failure.get("type") and str(failure["type"]) not in text:
        text = f"{failure['type']}: {text}"
    rank = failure.get("rank")
    if is_int(rank) and rank >= 0:
        coords = failure.get("coords") if isinstance(failure.get("coords"), dict) else {}
        where = " ".join(f"{d}{coords[d]}" for d in DIMS if d in coords)
        text = f"rank {rank}{f' ({where})' if where else ''}: {text}"
    return printable(text)


def _job_num(job_dir: Path) -> int | None:
    if job_dir.name.isdigit():
        return int(job_dir.name)
    num = _mapping(_mapping(_load_yaml(files.hydra_job(job_dir)), "hydra"), "job").get("num")
    return num if is_int(num) else None


def expand_sweep(overrides: list[Any]) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper expands parsed ``overrides``: the cartesian
    product of every key's values (a later override of a key replaces an earlier one, keeping its
    place), in order. Only discrete sweeps (``a=1,2``, ``choice``, ``range``); others raise
    ValueError.
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
    """Each job's overrides, in job-number order, as Hydra's basic sweeper expands
    ``multirun.yaml``.

    Empty when there is no ``multirun.yaml`` or its sweep cannot be expanded offline.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    hydra_cfg = _mapping(_load_yaml(Path(sweep_dir) / PLAN_FILE), "hydra")
    params = _mapping(hydra_cfg, "sweeper").get("params")
    task = _mapping(hydra_cfg, "overrides").get("task")
    args = [f"{k}={v}" for k, v in (params if isinstance(params, dict) else {}).items()]
    args += [str(o) for o in (task if isinstance(task, list) else [])]
    try:
        return expand_sweep(OverridesParser.create().parse_overrides(args))
    except Exception:
        return []


def _hydra_overrides(job_dir: Path) -> str:
    """The point's overrides from Hydra's record (``.hydra/overrides.yaml``), one string; '' when
    unreadable."""
    overrides = _load_yaml(files.hydra_overrides(job_dir))
    return " ".join(str(o) for o in overrides) if isinstance(overrides, list) else ""


def _point(job_dir: Path) -> dict[str, Any]:
    try:
        record = RunRecord.read(job_dir)
    except RecordError as exc:
        return {
            "job": _job_num(job_dir),
            "status": UNREADABLE,
            "overrides": redact_text(_hydra_overrides(job_dir)),
            **_layout({}, job_dir),
            "wall_s": None,
            "failure": printable(exc),
            "metrics": {},
            "dir": str(job_dir),
        }
    result = record.to_json() if record is not None else {}
    overrides = result.get("overrides")
    wall = (result.get("timings") or {}).get("wall_s")
    return {
        "job": _job_num(job_dir),
        "status": result.get("status") or INCOMPLETE,
        "overrides": redact_text(  # shown in the report's tables and charts
            " ".join(str(o) for o in overrides)
            if overrides is not None
            else _hydra_overrides(job_dir)
        ),
        **_layout(result, job_dir),
        "wall_s": wall if is_number(wall) else None,
        "failure": failure_text(result) if result.get("status") != "ok" else "",
        "metrics": point_metrics(result),
        "dir": str(job_dir),
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
    points = [
        _point(d)
        for d in sorted(sweep_dir.iterdir())
        if d.is_dir()
        and not d.is_symlink()  # a point is the sweep's own folder, never a link out of it
        and not d.name.startswith(".")
        and ((d / files.HYDRA).is_dir() or RunRecord.path(d).is_file())
    ]
    seen = {p["job"] for p in points}
    for num, overrides in enumerate(planned_points(sweep_dir)):
        if num not in seen:
            points.append(
                {
                    "job": num,
                    "status": NOT_RUN,
                    "overrides": redact_text(" ".join(overrides)),
                    **{d: None for d in DIMS},
                    "world": None,
                    "wall_s": None,
                    "failure": "",
                    "metrics": {},
                    "dir": "",
                }
            )
    return sorted(
        points, key=lambda p: (p["job"] is None, p["job"] if p["job"] is not None else 0, p["dir"])
    )


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
