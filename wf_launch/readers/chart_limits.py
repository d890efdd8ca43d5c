"""What one metrics chart draws at most, so a crafted or huge ``metrics.jsonl`` stays cheap to plot.

A run may report thousands of metrics (one 41 KB line with 3,000 of them took matplotlib over
300 s and 7.4 GB before these limits). :func:`cap` keeps the first :data:`MAX_PANELS` metrics,
the first :data:`MAX_LINES` lines of each, and thins each line to at most :data:`MAX_DRAWN`
evenly spread points; it returns what it left out, in words, for the console and the chart.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MAX_DRAWN", "MAX_LINES", "MAX_NAMES", "MAX_PANELS", "cap"]

MAX_PANELS = 24
"""The most metrics (panels) on one chart; name the metrics to choose which."""
MAX_LINES = 32
"""The most lines (ranks or runs) in one panel."""
MAX_DRAWN = 2_000
"""The most points drawn per line; longer lines are thinned evenly (first and last kept)."""
MAX_NAMES = 1_000
"""The most distinct metric names read from one run; the rest are counted, not kept."""


def _thin(points: list[Any]) -> list[Any]:
    if len(points) <= MAX_DRAWN:
        return points
    stride = math.ceil(len(points) / (MAX_DRAWN - 1))
    return points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])


def cap(
    series: dict[str, dict[Any, list[Any]]], total: int | None = None
) -> tuple[dict[str, dict[Any, list[Any]]], list[str]]:
    """``series`` within the limits, and one note per limit that cut something.

    ``total`` is how many metrics there were in all (more than ``len(series)`` when the reader
    stopped keeping names at :data:`MAX_NAMES`).
    """
    total = max(total or 0, len(series))
    notes = []
    if total > MAX_PANELS:
        notes.append(
            f"{MAX_PANELS} of {total} metrics drawn (name the metrics to draw after the paths)"
        )
    out: dict[str, dict[Any, list[Any]]] = {}
    cut_lines = thinned = False
    for name in list(series)[:MAX_PANELS]:
        keys = list(series[name])
        cut_lines |= len(keys) > MAX_LINES
        out[name] = {}
        for key in keys[:MAX_LINES]:
            points = _thin(series[name][key])
            thinned |= len(points) < len(series[name][key])
            out[name][key] = points
    if cut_lines:
        notes.append(f"at most {MAX_LINES} lines drawn per metric")
    if thinned:
        notes.append(f"lines thinned to at most {MAX_DRAWN} points")
    return out, notes
