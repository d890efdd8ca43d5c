"""A sweep's charts: the metric per point, throughput against world size, a metric over steps.

Each chart's title is its caption: ``sweep_summary.md`` quotes it, so the summary names what
each picture shows (the metric drawn, which may differ from the one asked for).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from worldfoundry.core.distributed.topology import DIMS

from ...rundir import files
from ..plot import load_metrics
from .figure import fit_width, legend_below, save_png, wrap_label
from .points import metric_value
from .tables import fmt, split_overrides

__all__ = [
    "bar_figure",
    "chart_metric",
    "render_charts",
    "scaling_figure",
    "steps_figure",
]

OK_COLOR, BAD_COLOR = "#4C72B0", "#C44E52"


def _pyplot() -> Any:
    import matplotlib  # optional, and seconds to import: only when a chart is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def chart_metric(points: list[dict[str, Any]], metric: str) -> str:
    """The metric the bar chart draws: ``metric``, or ``wall_s`` when no point reports it."""
    return metric if any(metric_value(p, metric) is not None for p in points) else "wall_s"


def _label(point: dict[str, Any], dims: list[str], varying: list[str]) -> str:
    sizes = "·".join(f"{d}{'?' if point[d] is None else point[d]}" for d in dims)
    world = point["world"]
    lines = [f"#{fmt(point['job'])} {sizes}".rstrip(), f"{'?' if world is None else world} rank(s)"]
    return "\n".join(
        lines + [o for o in point["overrides"].split() if o.split("=", 1)[0] in varying]
    )


def _value_bar(ax: Any, i: int, point: dict[str, Any], value: float, top: float) -> Any:
    """A bar of the point's value, written over it (red and hatched when the point did not end
    ok)."""
    ok = point["status"] == "ok"
    ax.bar(
        i,
        value,
        color=OK_COLOR if ok else BAD_COLOR,
        edgecolor="black",
        linewidth=0.6,
        hatch=None if ok else "//",
    )
    text = fmt(value) if ok else f"{fmt(value)}\n{point['status']}"
    return ax.text(i, value + top * 0.01, text, ha="center", va="bottom", fontsize=8)


def _missing_bar(ax: Any, i: int, point: dict[str, Any], top: float) -> Any:
    """A hatched stub for a point without a value, marked with its status (or n/a)."""
    ok = point["status"] == "ok"
    color = "grey" if ok else BAD_COLOR
    ax.bar(i, top * 0.06, color="white", edgecolor=color, hatch="xx", linewidth=1.0)
    return ax.text(
        i,
        top * 0.08,
        "n/a" if ok else point["status"].upper(),
        ha="center",
        va="bottom",
        fontsize=8,
        color=color,
        fontweight="bold",
        rotation=90,
    )


def _tick_labels(points: list[dict[str, Any]]) -> list[str]:
    """Each point's label: its job and the sizes and overrides that vary across the sweep."""
    _, keys = split_overrides(points)
    varying = [k for k in keys if not k.lstrip("+~").startswith("engine.")]
    dims = [d for d in DIMS if len({p[d] for p in points}) > 1]
    return [_label(p, dims, varying) for p in points]


def _finite(value: float | int | None) -> bool:
    return value is not None and math.isfinite(value)


def bar_figure(points: list[dict[str, Any]], metric: str) -> tuple[Any, str]:
    """(the figure, its caption): a bar of ``metric`` per point; points without one marked by
    status."""
    plt = _pyplot()
    drawn = chart_metric(points, metric)
    values = [metric_value(p, drawn) for p in points]
    top = max([v for v in values if _finite(v)] or [1.0]) or 1.0
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(points) + 2), 4.6), dpi=110)
    notes = [
        _value_bar(ax, i, p, v, top) if _finite(v) else _missing_bar(ax, i, p, top)
        for i, (p, v) in enumerate(zip(points, values))
    ]
    ax.set_xticks(range(len(points)), _tick_labels(points), fontsize=8)
    ax.set_ylabel(drawn)
    ax.set_ylim(0, top * 1.2)
    caption = f"{drawn} per point" + (f" (no point reported {metric})" if drawn != metric else "")
    ax.set_title(caption, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fit_width(fig, ax, notes)
    return fig, caption


def scaling_figure(points: list[dict[str, Any]], metric: str) -> tuple[Any, str] | None:
    """(the figure, its caption): throughput against world size, with ideal linear scaling from
    the smallest world; None if the sweep does not vary the world size or no ok point reports
    ``metric``."""
    ok = [
        p
        for p in points
        if p["status"] == "ok"
        and isinstance(p.get("world"), int)
        and metric_value(p, metric) is not None
    ]
    worlds = sorted({p["world"] for p in ok})
    if len(worlds) < 2:
        return None
    plt = _pyplot()
    best = {w: max(metric_value(p, metric) for p in ok if p["world"] == w) for w in worlds}
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=110)
    for p in ok:
        ax.scatter(p["world"], metric_value(p, metric), color=OK_COLOR, alpha=0.45, s=18)
    ax.plot(worlds, [best[w] for w in worlds], "o-", color=OK_COLOR, label="best layout per size")
    base = worlds[0]
    ax.plot(
        worlds,
        [best[base] * w / base for w in worlds],
        "--",
        color="grey",
        label=f"ideal linear scaling from {base} rank(s)",
    )
    caption = f"{metric} against world size"
    ax.set(xscale="log", xlabel="ranks (world size)", ylabel=metric, title=caption)
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig, caption


def steps_figure(points: list[dict[str, Any]], metric: str | None = None) -> tuple[Any, str] | None:
    """(the figure, its caption): one metric over steps (each point's ``metrics.jsonl``), a line per
    point named by the overrides that set it apart; None when no point reported progress metrics."""
    series = {p["job"]: load_metrics(p["dir"]) for p in points if p.get("dir")}
    names = [n for s in series.values() for n in s]
    if not names:
        return None
    drawn = metric if metric in names else ("loss" if "loss" in names else names[0])
    plt = _pyplot()
    common, _ = split_overrides(points)
    fig, ax = plt.subplots(figsize=(7.0, 4.4), dpi=110, layout="constrained")
    for i, p in enumerate(points):
        by_rank = series.get(p["job"], {}).get(drawn)
        if by_rank:
            steps = sorted(by_rank[min(by_rank)])
            own = " ".join(o for o in p["overrides"].split() if o not in common)
            label = wrap_label(f"job {fmt(p['job'])}: {own or 'the common overrides'}")
            style = ("-", "--", ":", "-.")[i // 10 % 4]  # ten colours, then the next style
            ax.plot([s for s, _ in steps], [v for _, v in steps], style, lw=1.3, label=label)
    caption = f"{drawn} over steps, one line per point"
    ax.set(xlabel="step", ylabel=drawn, title=caption)
    ax.grid(alpha=0.3)
    legend_below(fig, ax)
    return fig, caption


def render_charts(
    points: list[dict[str, Any]], metric: str, sweep_dir: Path
) -> dict[str, tuple[Path, str]]:
    """Draw the sweep's charts into ``sweep_dir``: ``{"png" | "scaling" | "steps": (path,
    caption)}``.

    :class:`ImportError` when matplotlib is not installed.
    """
    drawn = {
        "png": (files.SWEEP_CHART, bar_figure(points, metric)),
        "scaling": (files.SWEEP_SCALING, scaling_figure(points, metric)),
        "steps": (files.SWEEP_STEPS, steps_figure(points)),
    }
    out = {}
    for key, (name, made) in drawn.items():
        if made is not None:
            save_png(made[0], sweep_dir / name)
            out[key] = (sweep_dir / name, made[1])
    return out
