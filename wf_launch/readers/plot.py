"""``python -m wf_launch.plot PATH [PATH ...] [METRIC ...]``: runs' metrics over steps, as one PNG.

Each ``PATH`` is a run directory or a sweep directory (standing for each of its points); the
other arguments name metrics. It reads each run's ``metrics.jsonl`` (what
``ctx.progress(step, **metrics)`` appends on every rank) and draws each metric against the step,
one panel per metric: one line per reporting rank for one run (rank 0 alone unless
``--all-ranks``), one line per run for several (a sweep's points on one chart, each named by the
overrides that set it apart). Writes ``RUN_DIR/metrics.png`` (a sweep's: ``SWEEP_DIR/metrics.png``;
several runs: their common parent's) unless ``--out`` says where.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from worldfoundry.core.validation import is_int, is_number

from ..rundir import files
from ..rundir.io import atomic_write_bytes, open_regular, read_yaml
from ..rundir.text import printable

__all__ = [
    "MAX_METRICS",
    "MAX_PANELS",
    "MAX_POINTS",
    "Series",
    "expand_runs",
    "load_metrics",
    "main",
    "metric_lines",
    "render",
    "run_labels",
]

Series = dict[str, dict[str, list[tuple[int, float]]]]
"""metric -> line label -> [(step, value)]."""


MAX_POINTS = 20_000
"""The most points kept per metric and rank: beyond it every other point is dropped (a chart shows
no more)."""
MAX_LINE_BYTES = 1 << 20
MAX_METRICS = 256
"""The most metric names read from a run's file (the first seen); more are ignored."""
MAX_PANELS = 16
"""The most metrics drawn on one chart unless named (one panel each: 3,000 took 300 s and 7 GB)."""
"""A metrics line longer than this is skipped, not read whole."""


def metric_lines(path: Path, max_line: int = MAX_LINE_BYTES) -> Iterator[str]:
    """The lines of a metrics file, streamed (never the whole file in memory); over-long lines
    skipped.

    Nothing when the file is missing or not a regular file (a FIFO or device is never read).
    """
    try:
        fd = open_regular(path)
    except (OSError, ValueError):
        return
    with open(fd, "rb") as f:
        while line := f.readline(max_line + 1):
            if len(line) > max_line and not line.endswith(b"\n"):
                while (rest := f.readline(max_line + 1)) and not rest.endswith(b"\n"):
                    pass
                continue
            yield line.decode(errors="replace")


class _Series(list):  # type: ignore[type-arg]
    """(step, value) points of one metric of one rank, thinned to at most :data:`MAX_POINTS`."""

    def __init__(self) -> None:
        super().__init__()
        self.stride, self.seen = 1, 0

    def add(self, point: tuple[int, float]) -> None:
        self.seen += 1
        if (self.seen - 1) % self.stride:
            return
        self.append(point)
        if len(self) > MAX_POINTS:
            del self[1::2]
            self.stride *= 2


def load_metrics(run_dir: Path | str) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """metric -> rank -> [(step, value)] from ``metrics.jsonl``, read line by line (bad lines are
    skipped).

    A long run's file may hold GBs: it is streamed, and each series keeps at most
    :data:`MAX_POINTS` evenly spread points.
    """
    out: dict[str, dict[int, _Series]] = defaultdict(lambda: defaultdict(_Series))
    for line in metric_lines(files.metrics_file(run_dir)):
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(row, dict) or not is_int(row.get("step")):
            continue
        rank = row.get("rank", 0)
        if not is_int(rank):
            continue
        for name, value in row.items():
            if name in ("rank", "step", "time") or not is_number(value):
                continue
            if math.isfinite(value) and (name in out or len(out) < MAX_METRICS):
                out[name][rank].add((row["step"], float(value)))
    return {k: {r: list(points) for r, points in v.items()} for k, v in out.items()}


def _is_run(path: Path) -> bool:
    return files.metrics_file(path).is_file() or files.config_path(path).is_file()


def expand_runs(paths: list[Path]) -> list[Path]:
    """Run directories: each path itself, or a sweep directory's points (its sub-directories that
    hold a run)."""
    runs: list[Path] = []
    for path in paths:
        if _is_run(path):
            runs.append(path)
            continue
        points = [p for p in path.iterdir() if p.is_dir() and _is_run(p)] if path.is_dir() else []
        runs += sorted(
            points,
            key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name),
        )
    return runs


def _overrides(run_dir: Path) -> list[str]:
    for path in (run_dir / files.OVERRIDES, files.hydra_overrides(run_dir)):
        try:
            data = read_yaml(path, 1 << 20)
        except (OSError, ValueError):
            continue
        if isinstance(data, list):
            return [str(o) for o in data]
    return []


def run_labels(runs: list[Path]) -> dict[Path, str]:
    """Each run's name on the chart: the overrides no other run shares (a sweep point's), else its
    directory."""
    if len(runs) == 1:
        return {runs[0]: printable(runs[0].name)}
    given = {run: _overrides(run) for run in runs}
    common = set.intersection(*(set(o) for o in given.values())) if given else set()
    labels = {}
    for run in runs:
        own = [o for o in given[run] if o not in common and not o.startswith("hydra.")]
        labels[run] = printable(" ".join(own) if own else run.name)
    if len(set(labels.values())) < len(labels):
        labels = {
            run: f"{printable(run.name)}: {label}" if label != printable(run.name) else label
            for run, label in labels.items()
        }
    return labels


def collect(runs: list[Path], all_ranks: bool) -> Series:
    """Every run's metrics, as lines: a run's rank 0 (every rank with ``all_ranks``), named for the
    chart."""
    labels = run_labels(runs)
    out: Series = defaultdict(dict)
    for run in runs:
        for metric, by_rank in load_metrics(run).items():
            ranks = sorted(by_rank) if all_ranks else sorted(by_rank)[:1]
            for rank in ranks:
                name = (
                    f"rank {rank}"
                    if len(runs) == 1
                    else f"{labels[run]}" + (f" r{rank}" if all_ranks else "")
                )
                out[metric][name] = sorted(by_rank[rank])
    return dict(out)


def render(
    series: Series | dict[str, dict[int, list[tuple[int, float]]]],
    path: Path,
    title: str,
    all_ranks: bool = False,
) -> Path:
    """Draw ``series`` into ``path``: one panel per metric, one line per entry (a rank or a run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(series)
    cols = min(2, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 3.6 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        lines = series[name]
        keys = (
            list(lines)
            if all_ranks or any(isinstance(k, str) for k in lines)
            else sorted(lines)[:1]
        )
        for key in keys:
            points = sorted(lines[key])
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                lw=1.4,
                label=key if isinstance(key, str) else f"rank {key}",
            )
        ax.set(title=name, xlabel="step", ylabel=name)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    fig.suptitle(printable(title), fontsize=10)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, dpi=110, format="png")
    plt.close(fig)
    atomic_write_bytes(path, png.getvalue())  # a link at path is replaced, never written through
    return path


def _default_out(paths: list[Path], runs: list[Path]) -> Path:
    if len(paths) == 1:
        return files.metrics_chart(paths[0])
    return files.metrics_chart(Path(os.path.commonpath([str(r.absolute()) for r in runs])))


def _missing(series: Series, wanted: list[str], paths: list[Path], runs: list[Path]) -> str | None:
    """Why nothing can be drawn: no metrics at all, or a metric asked for that no run has."""
    if not series:
        where = (
            files.metrics_file(paths[0])
            if len(runs) <= 1
            else f"the {files.METRICS} of {len(runs)} runs"
        )
        return f"no metrics in {where} (tasks report them with ctx.progress(step, name=value))"
    unknown = [m for m in wanted if m not in series]
    if unknown:
        where = files.metrics_file(runs[0]) if len(runs) == 1 else f"{len(runs)} runs"
        return f"no metric {unknown[0]!r} in {where}; it has {sorted(series)}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Plot runs' metrics."""
    ap = argparse.ArgumentParser(
        prog="python -m wf_launch.plot", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "paths",
        nargs="+",
        metavar="PATH_OR_METRIC",
        help="run or sweep directories, then the metrics to draw (default: every numeric one)",
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="PNG path (default: RUN_DIR/metrics.png)"
    )
    ap.add_argument("--all-ranks", action="store_true", help="one line per rank, not rank 0 alone")
    args = ap.parse_args(argv)
    paths = [Path(p) for p in args.paths if Path(p).is_dir()]
    wanted = [p for p in args.paths if not Path(p).is_dir()]
    if not paths:
        print(printable(f"wf_launch.plot: no run directory among {args.paths}"), file=sys.stderr)
        return 2
    runs = expand_runs(paths)
    series = collect(runs, args.all_ranks)
    missing = _missing(series, wanted, paths, runs)
    if missing is not None:
        print(printable(f"wf_launch.plot: {missing}"), file=sys.stderr)
        return 2
    chosen = _chosen(series, wanted)
    title = str(paths[0]) if len(paths) == 1 else f"{len(runs)} runs"
    out = render(chosen, args.out or _default_out(paths, runs), title, all_ranks=True)
    print(printable(out))
    return 0


def _chosen(series: Series, wanted: list[str]) -> Series:
    """The metrics to draw: those named, else every one; at most :data:`MAX_PANELS`, saying so."""
    names = wanted or sorted(series)
    if len(names) > MAX_PANELS or (not wanted and len(series) >= MAX_METRICS):
        print(
            printable(
                f"wf_launch.plot: {len(series)}{'+' if len(series) >= MAX_METRICS else ''} "
                f"metrics; drawing {min(len(names), MAX_PANELS)} "
                f"({', '.join(names[:MAX_PANELS])}); name the metrics to draw others"
            ),
            file=sys.stderr,
        )
    return {m: series[m] for m in names[:MAX_PANELS]}


if __name__ == "__main__":
    sys.exit(main())
