"""``python -m wf_launch.plot RUN_DIR [METRIC ...]``: a run's metrics over steps, as a PNG.

Reads ``RUN_DIR/metrics.jsonl`` (what ``ctx.progress(step, **metrics)`` appends
on every rank) and draws each metric against the step, one panel per metric,
one line per reporting rank (rank 0 alone unless ``--all-ranks``). Writes
``RUN_DIR/metrics.png`` unless ``--out`` says where.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from worldfoundry.core.validation import is_int, is_number

from ..rundir import files
from ..rundir.io import open_regular
from ..rundir.text import printable

__all__ = ["MAX_POINTS", "load_metrics", "main", "metric_lines", "render"]


MAX_POINTS = 20_000
"""The most points kept per metric and rank: beyond it every other point is dropped (a chart shows no more)."""
MAX_LINE_BYTES = 1 << 20
"""A metrics line longer than this is skipped, not read whole."""


def metric_lines(path: Path, max_line: int = MAX_LINE_BYTES) -> Iterator[str]:
    """The lines of a metrics file, streamed (never the whole file in memory); over-long lines skipped.

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
    """metric -> rank -> [(step, value)] from ``metrics.jsonl``, read line by line (bad lines are skipped).

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
            if math.isfinite(value):
                out[name][rank].add((row["step"], float(value)))
    return {k: {r: list(points) for r, points in v.items()} for k, v in out.items()}


def render(series: dict[str, dict[int, list[tuple[int, float]]]], path: Path, title: str,
           all_ranks: bool = False) -> Path:
    """Draw ``series`` into ``path`` (one panel per metric)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(series)
    cols = min(2, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 3.6 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        by_rank: dict[int, Any] = series[name]
        ranks = sorted(by_rank) if all_ranks else sorted(by_rank)[:1]
        for rank in ranks:
            points = sorted(by_rank[rank])
            ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.4, label=f"rank {rank}")
        ax.set(title=name, xlabel="step", ylabel=name)
        ax.grid(alpha=0.3)
        if len(ranks) > 1:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """Plot a run's metrics."""
    ap = argparse.ArgumentParser(prog="python -m wf_launch.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("metrics", nargs="*", help="metrics to draw (default: every numeric one)")
    ap.add_argument("--out", type=Path, default=None, help="PNG path (default: RUN_DIR/metrics.png)")
    ap.add_argument("--all-ranks", action="store_true", help="one line per rank, not rank 0 alone")
    args = ap.parse_args(argv)
    series = load_metrics(args.run_dir)
    if not series:
        print(f"wf_launch.plot: no metrics in {files.metrics_file(args.run_dir)} (tasks report them with "
              "ctx.progress(step, name=value))", file=sys.stderr)
        return 2
    unknown = [m for m in args.metrics if m not in series]
    if unknown:
        print(printable(f"wf_launch.plot: no metric {unknown[0]!r} in {files.metrics_file(args.run_dir)}; it has "
                        f"{sorted(series)}"), file=sys.stderr)
        return 2
    chosen = {m: series[m] for m in (args.metrics or series)}
    out = render(chosen, args.out or files.metrics_chart(args.run_dir), str(args.run_dir), args.all_ranks)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
