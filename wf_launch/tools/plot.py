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
from pathlib import Path
from typing import Any

from worldfoundry.core.validation import is_number

from ..rundir import files

__all__ = ["load_metrics", "main", "render"]


def load_metrics(run_dir: Path | str) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """metric -> rank -> [(step, value)] from ``metrics.jsonl`` (bad lines are skipped)."""
    out: dict[str, dict[int, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    try:
        lines = files.metrics_file(run_dir).read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            continue
        for name, value in row.items():
            if name in ("rank", "step", "time") or not is_number(value):
                continue
            if math.isfinite(value):
                out[name][int(row.get("rank", 0))].append((row["step"], float(value)))
    return {k: dict(v) for k, v in out.items()}


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
        print(f"wf_launch.plot: no metric {unknown[0]!r} in {files.metrics_file(args.run_dir)}; it has "
              f"{sorted(series)}", file=sys.stderr)
        return 2
    chosen = {m: series[m] for m in (args.metrics or series)}
    out = render(chosen, args.out or files.metrics_chart(args.run_dir), str(args.run_dir), args.all_ranks)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
