"""``python -m wf_launch.runs [DIR ...]``: the runs and sweeps under ``outputs/`` and ``multirun/``,
newest first.

A run is a directory holding ``result.json`` or the ``config.yaml`` a launch
writes; a sweep is a directory holding Hydra's ``multirun.yaml``, and its points
are runs. Every record is read through :class:`~wf_launch.record.RunRecord`: a
record that cannot be read is listed as ``unreadable``, never a crash; a run with
no record yet is ``running``, or ``unknown`` when it is a local run whose launcher
is gone (a detached run, e.g. on SLURM, has no launcher process to check). What a
launcher says of its runs comes from its hooks (:class:`~wf_launch.launchers.LauncherHooks`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from worldfoundry.core.distributed.topology import DIMS

from ..launchers import get_launcher
from ..rundir import files
from ..rundir.record import RecordError, RunRecord
from ..rundir.text import printable
from .sweep.points import DEFAULT_METRIC, PLAN_FILE, point_metrics

__all__ = ["RunRow", "list_runs", "main", "render"]

UNREADABLE, RUNNING = "unreadable", "running"
_MAX_DEPTH = 4


@dataclass
class RunRow:
    """One line of the list."""

    when: float
    status: str
    task: str
    layout: str
    world: int | None
    launcher: str
    wall_s: float | None
    metric: str
    run_dir: str
    sweep: str
    problem: str = ""
    recovered: int = 0
    """Under ``ft=torchft``: how many times a replica group failed and rejoined."""


def _walk(root: Path, depth: int = 0) -> Iterator[Path]:
    """Run directories under ``root`` (not descending into a run's own folders)."""
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return
    if RunRecord.path(root).exists() or files.config_path(root).exists():
        yield root
        return
    if depth >= _MAX_DEPTH:
        return
    for entry in entries:
        if entry.is_dir() and not entry.name.startswith(".") and not entry.is_symlink():
            yield from _walk(entry, depth + 1)


def _sweep_of(run_dir: Path) -> str:
    return str(run_dir.parent) if (run_dir.parent / PLAN_FILE).is_file() else ""


def _layout_of(record: RunRecord | None, run_dir: Path) -> tuple[str, int | None]:
    sizes: dict[str, Any] = dict(record.layout or {}) if record is not None else {}
    if not all(d in sizes for d in DIMS):
        engine = files.read_config(run_dir).get("engine")
        if not isinstance(engine, dict):
            return "?", None
        sizes = {d: engine.get(f"{d}_size") for d in DIMS}
    if not all(isinstance(sizes.get(d), int) for d in DIMS):
        return "?", None
    world = 1
    for d in DIMS:
        world *= sizes[d]
    return "/".join(str(sizes[d]) for d in DIMS), world


def _ft_marks(record: RunRecord, layout: str, world: int | None) -> tuple[int, str, int | None]:
    """Under ``ft=torchft``: how often a replica group recovered, and the replica groups in the
    layout and world ('2x1/1/1/2')."""
    ft = record.extra.get("ft")
    if not isinstance(ft, dict) or not isinstance(ft.get("replicas"), int):
        return 0, layout, world
    n = ft["replicas"]
    recoveries = ft.get("recoveries") if isinstance(ft.get("recoveries"), list) else []
    return len(recoveries), f"{n}x{layout}", None if world is None else n * world


def _headline(record: RunRecord) -> str:
    metrics = point_metrics(record.to_json())
    if DEFAULT_METRIC in metrics:
        return f"{DEFAULT_METRIC}={metrics[DEFAULT_METRIC]:.4g}"
    for name, value in metrics.items():
        return f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}"
    return ""


def _named_in_config(run_dir: Path) -> tuple[str, str]:
    """The task and launcher names a run's ``config.yaml`` gives (a run with no record yet)."""
    config = files.read_config(run_dir)
    names = [
        section.get("name") if isinstance(section := config.get(key), dict) else None
        for key in ("task", "launcher")
    ]
    task, launcher = (name if isinstance(name, str) else "?" for name in names)
    return task, launcher


def _launcher_column(name: str, run_dir: Path, record: RunRecord | None) -> str:
    """The run's launcher as its hook names it ('slurm 42'); the bare name when that launcher is
    unknown here."""

    try:
        return get_launcher(name).run_label(run_dir, record)
    except Exception:
        return name


def _gone(name: str, run_dir: Path) -> bool:
    """Whether a run with no record has lost its launcher (its ``is_live`` hook: a SLURM job is left
    to the scheduler, a Ray run to whatever monitors it)."""

    try:
        launcher = get_launcher(name)
    except Exception:
        return False
    try:
        return not launcher.is_live(run_dir)
    except Exception:
        return False


def _row(run_dir: Path) -> RunRow:
    """The run's row; a run whose files cannot be read is listed as unreadable, with why."""
    try:
        return _read_row(run_dir)
    except (ValueError, OSError) as exc:
        return RunRow(
            0.0,
            UNREADABLE,
            "?",
            "?",
            None,
            "?",
            None,
            "",
            str(run_dir),
            _sweep_of(run_dir),
            str(exc),
        )


def _read_row(run_dir: Path) -> RunRow:
    when = os.stat(run_dir).st_mtime
    try:
        record = RunRecord.read(run_dir)
    except RecordError as exc:
        layout, world = _layout_of(None, run_dir)
        return RunRow(
            when,
            UNREADABLE,
            "?",
            layout,
            world,
            "?",
            None,
            "",
            str(run_dir),
            _sweep_of(run_dir),
            str(exc),
        )
    layout, world = _layout_of(record, run_dir)
    if record is None:
        task, launcher = _named_in_config(run_dir)
        status, problem = RUNNING, ""
        if _gone(launcher, run_dir):
            status, problem = (
                "unknown",
                f"its launcher is gone and left no {files.RESULT} (killed?)",
            )
        return RunRow(
            when,
            status,
            task,
            layout,
            world,
            _launcher_column(launcher, run_dir, None),
            None,
            "",
            str(run_dir),
            _sweep_of(run_dir),
            problem,
        )
    launcher = _launcher_column(record.launcher or "?", run_dir, record)
    wall = record.timings.get("wall_s")
    wall = wall if isinstance(wall, (int, float)) and math.isfinite(wall) else None
    finished = (
        record.finished_at
        if record.finished_at is not None and math.isfinite(record.finished_at)
        else None
    )
    recovered, layout, world = _ft_marks(record, layout, world)
    return RunRow(
        finished or when,
        str(record.status),
        record.task or "?",
        layout,
        world,
        launcher,
        wall,
        _headline(record),
        str(run_dir),
        _sweep_of(run_dir),
        recovered=recovered,
    )


def list_runs(roots: list[Path]) -> list[RunRow]:
    """Every run under ``roots``, newest first."""
    seen: set[Path] = set()
    rows = []
    for root in roots:
        for run_dir in _walk(root):
            if run_dir.resolve() not in seen:
                seen.add(run_dir.resolve())
                rows.append(_row(run_dir))
    return sorted(rows, key=lambda r: r.when, reverse=True)


def render(rows: list[RunRow]) -> str:
    """A fixed-width table of ``rows``."""
    head = ["when", "status", "task", "tp/cp/pp/dp", "world", "launcher", "wall_s", "metric", "run"]
    cells = [
        [
            printable(c)
            for c in (
                _when(r.when),
                f"{r.status}, recovered {r.recovered}x" if r.recovered else r.status,
                r.task,
                r.layout,
                "" if r.world is None else r.world,
                r.launcher,
                "" if r.wall_s is None else f"{r.wall_s:.2f}",
                r.metric,
                _rel(r.run_dir),
            )
        ]
        for r in rows
    ]
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(head)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    for row, cell in zip(rows, cells):
        lines.append("  ".join(c.ljust(w) for c, w in zip(cell, widths)).rstrip())
        if row.problem:
            lines.append(f"    {printable(row.problem)}")
    return "\n".join(lines)


def _when(stamp: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))
    except (OverflowError, OSError, ValueError):
        return "?"


def _rel(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def main(argv: list[str] | None = None) -> int:
    """List runs and sweeps, newest first."""
    ap = argparse.ArgumentParser(
        prog="python -m wf_launch.runs", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "dirs", nargs="*", type=Path, help="where to look (default: outputs/ and multirun/)"
    )
    ap.add_argument(
        "--status",
        help="only runs with this status (ok, failed, invalid, unreadable, running, ...)",
    )
    ap.add_argument("--json", action="store_true", help="machine-readable output (a JSON list)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many runs (0: all)")
    args = ap.parse_args(argv)
    roots = args.dirs or [p for p in (Path("outputs"), Path("multirun")) if p.is_dir()]
    missing = [str(p) for p in roots if not p.is_dir()]
    if missing:
        print(f"wf_launch.runs: not a directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    rows = list_runs(roots)
    if args.status:
        rows = [r for r in rows if r.status == args.status]
    if args.limit > 0:
        rows = rows[: args.limit]
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    elif rows:
        print(render(rows))
    else:
        print(
            "no runs found" + (f" with status {args.status!r}" if args.status else ""),
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
