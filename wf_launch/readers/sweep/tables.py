"""A sweep's summary as text: CSV (every metric, full precision) and a Markdown table."""

from __future__ import annotations

import csv
import io
import math
from collections import Counter
from pathlib import Path
from typing import Any

from worldfoundry.core.distributed.topology import DIMS

from .points import BASE_COLUMNS, metric_names

__all__ = ["fmt", "render_csv", "render_markdown", "split_overrides"]


def fmt(value: Any) -> str:
    """A cell's text: empty for None, floats to about three significant digits."""
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


def split_overrides(points: list[dict[str, Any]]) -> tuple[list[str], set[str]]:
    """Overrides every point shares (in order), and the keys whose values differ between them."""
    per_point = [p["overrides"].split() for p in points if p["overrides"]]
    common = (
        [o for o in per_point[0] if all(o in other for other in per_point)] if per_point else []
    )
    keys = {o.split("=", 1)[0] for ovs in per_point for o in ovs if o not in common}
    return common, keys


def render_csv(points: list[dict[str, Any]], metric: str) -> str:
    """The summary as CSV: base columns, every metric (full precision), failure."""
    names = metric_names(points, metric)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*BASE_COLUMNS, *names, "failure"])
    for p in points:
        writer.writerow(
            [
                *("" if p.get(c) is None else p[c] for c in BASE_COLUMNS),
                *("" if p["metrics"].get(m) is None else p["metrics"][m] for m in names),
                p["failure"],
            ]
        )
    return out.getvalue()


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _md_row(p: dict[str, Any], common: list[str], names: list[str]) -> str:
    """One point's row: job, status (bold unless ok), its own overrides, layout, metrics."""
    layout = "/".join(fmt(p[d]) if p[d] is not None else "?" for d in DIMS)
    status = p["status"] if p["status"] == "ok" else f"**{p['status']}**"
    own = " ".join(o for o in p["overrides"].split() if o not in common)
    row = [
        fmt(p["job"]),
        status,
        f"`{own}`" if own else "",
        layout,
        fmt(p["world"]),
        fmt(p["wall_s"]),
        *(fmt(p["metrics"].get(m)) for m in names),
    ]
    return "| " + " | ".join(_md_cell(c) for c in row) + " |"


def _md_failures(points: list[dict[str, Any]]) -> list[str]:
    """The section listing the points that did not succeed (none when every point did)."""
    failures = [p for p in points if p["failure"]]
    if not failures:
        return []
    return [
        "",
        "## Points that did not succeed",
        "",
        *(f"- job {fmt(p['job'])} ({p['status']}): {p['failure']}" for p in failures),
    ]


def _charts_lines(charts: dict[str, str]) -> list[str]:
    """One line per chart: its file and its caption (what it shows)."""
    if not charts:
        return []
    return ["Charts:", "", *(f"- `{name}`: {caption}" for name, caption in charts.items()), ""]


def render_markdown(
    points: list[dict[str, Any]],
    metric: str,
    sweep_dir: Path | str,
    charts: dict[str, str] | None = None,
) -> str:
    """The summary as a Markdown table, with a count per status and the failures listed.

    ``charts`` maps each chart's file name to its caption (the metric it shows).
    """
    names = metric_names(points, metric)
    counts = Counter(p["status"] for p in points)
    lines = [
        f"# Sweep summary: {Path(sweep_dir).name}",
        "",
        f"{len(points)} point(s): " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".",
        "",
        *_charts_lines(charts or {}),
    ]
    common, _ = split_overrides(points)
    if common:
        lines += ["Every point: `" + " ".join(common) + "`", ""]
    header = ["job", "status", "overrides", "layout (tp/cp/pp/dp)", "world", "wall_s", *names]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [_md_row(p, common, names) for p in points]
    lines += _md_failures(points)
    return "\n".join(lines) + "\n"
