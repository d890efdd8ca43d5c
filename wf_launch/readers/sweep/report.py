"""Writing a sweep's report (``sweep_summary.csv`` / ``.md``, the charts), its exit code, and the
CLI.

``python -m wf_launch.sweep_report SWEEP_DIR [--metric M]`` rebuilds the report from the
job directories alone (:mod:`.points`); the Hydra callback (:mod:`.callback`) writes it
when a ``-m`` sweep ends.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ...rundir import files
from ...rundir.io import atomic_write_text
from ...rundir.record import Status
from .charts import render_charts
from .points import DEFAULT_METRIC, FAILED_STATUSES, collect_points
from .tables import render_csv, render_markdown

__all__ = ["main", "status_line", "sweep_exit_code", "write_report"]


def write_report(
    sweep_dir: Path | str,
    points: list[dict[str, Any]],
    metric: str = DEFAULT_METRIC,
    chart: bool = True,
) -> dict[str, Path]:
    """Write ``sweep_summary.csv``, the charts (``chart``) and ``sweep_summary.md`` atomically.

    The summary quotes each chart's caption, so it names the metric each one actually shows.
    Without matplotlib the charts are skipped with a note on stderr. Returns the paths written.
    """
    sweep_dir = Path(sweep_dir)
    written = {"csv": sweep_dir / files.SWEEP_CSV, "md": sweep_dir / files.SWEEP_MD}
    atomic_write_text(written["csv"], render_csv(points, metric))
    charts: dict[str, tuple[Path, str]] = {}
    if chart and points:
        try:
            charts = render_charts(points, metric, sweep_dir)
        except ImportError:
            print(
                "wf_launch: sweep chart skipped: matplotlib is not installed "
                "(pip install matplotlib)",
                file=sys.stderr,
            )
    captions = {path.name: caption for path, caption in charts.values()}
    atomic_write_text(written["md"], render_markdown(points, metric, sweep_dir, captions))
    written.update({key: path for key, (path, _) in charts.items()})
    return written


def sweep_exit_code(points: list[dict[str, Any]]) -> int:
    """1 if any point failed or was interrupted, else 2 if any was invalid, else 0."""
    statuses = {p["status"] for p in points}
    if statuses & FAILED_STATUSES:
        return 1
    return 2 if Status.INVALID in statuses else 0


def status_line(points: list[dict[str, Any]], written: dict[str, Path]) -> str:
    counts: dict[str, int] = {}
    for p in points:
        counts[p["status"]] = counts.get(p["status"], 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    return f"wf_launch: sweep report ({summary}): {written['md']}"


def main(argv: list[str] | None = None) -> int:
    """``python -m wf_launch.sweep_report SWEEP_DIR [--metric M]``: rebuild the report from the job
    dirs."""
    ap = argparse.ArgumentParser(prog="python -m wf_launch.sweep_report", description=main.__doc__)
    ap.add_argument("sweep_dir", type=Path, help="the multirun directory (hydra.sweep.dir)")
    ap.add_argument(
        "--metric",
        default=DEFAULT_METRIC,
        help=f"metric to chart (default {DEFAULT_METRIC}; any numeric result field, or wall_s)",
    )
    ap.add_argument("--no-chart", action="store_true", help="write only the CSV and Markdown")
    ap.add_argument("--json", action="store_true", help="also print the points as JSON on stdout")
    args = ap.parse_args(argv)
    try:
        points = collect_points(args.sweep_dir)
    except FileNotFoundError as exc:
        print(f"wf_launch.sweep_report: {exc}", file=sys.stderr)
        return 2
    if not points:
        print(
            f"wf_launch.sweep_report: no job directories (with {files.HYDRA}/ or {files.RESULT}) "
            "in "
            f"{str(args.sweep_dir)!r}",
            file=sys.stderr,
        )
        return 2
    written = write_report(args.sweep_dir, points, args.metric, chart=not args.no_chart)
    if args.json:
        print(json.dumps(points, indent=2, default=str))
    print(status_line(points, written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
