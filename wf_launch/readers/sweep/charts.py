"""A sweep's charts: the metric per point, throughput against world size, a metric over steps."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any

from worldfoundry.core.distributed.topology import DIMS

from ..plot import load_metrics
from .points import metric_value
from .tables import fmt, split_overrides

__all__ = ["render_chart", "render_scaling_chart", "render_steps_chart", "save_figure"]


def _label(point: dict[str, Any], dims: list[str], varying: list[str]) -> str:
    sizes = "·".join(f"{d}{'?' if point[d] is None else point[d]}" for d in dims)
    world = point["world"]
    lines = [f"#{fmt(point['job'])} {sizes}".rstrip(), f"{'?' if world is None else world} rank(s)"]
    return "\n".join(
        lines + [o for o in point["overrides"].split() if o.split("=", 1)[0] in varying]
    )


def render_chart(points: list[dict[str, Any]], metric: str, path: Path | str) -> str:
    """Bar chart of ``metric`` per point at ``path``; points without a value are marked by status.

    Returns the metric actually drawn: ``wall_s`` when no point reports ``metric``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = metric if any(metric_value(p, metric) is not None for p in points) else "wall_s"
    _, keys = split_overrides(points)
    varying = [k for k in keys if not k.lstrip("+~").startswith("engine.")]
    dims = [d for d in DIMS if len({p[d] for p in points}) > 1]
    values = [metric_value(p, drawn) for p in points]
    top = max([v for v in values if v is not None and math.isfinite(v)] or [1.0]) or 1.0
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(points) + 2), 4.6), dpi=110)
    for i, (p, v) in enumerate(zip(points, values)):
        ok = p["status"] == "ok"
        if v is not None and math.isfinite(v):
            ax.bar(
                i,
                v,
                color="#4C72B0" if ok else "#C44E52",
                edgecolor="black",
                linewidth=0.6,
                hatch=None if ok else "//",
            )
            ax.text(
                i,
                v + top * 0.01,
                fmt(v) if ok else f"{fmt(v)}\n{p['status']}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
        else:
            ax.bar(
                i,
                top * 0.06,
                color="white",
                edgecolor="#C44E52" if not ok else "grey",
                hatch="xx",
                linewidth=1.0,
            )
            ax.text(
                i,
                top * 0.08,
                p["status"].upper() if not ok else "n/a",
                ha="center",
                va="bottom",
                fontsize=8,
                color="#C44E52" if not ok else "grey",
                fontweight="bold",
                rotation=90,
            )
    ax.set_xticks(range(len(points)), [_label(p, dims, varying) for p in points], fontsize=8)
    ax.set_ylabel(drawn)
    ax.set_ylim(0, top * 1.2)
    title = f"{drawn} per layout"
    if drawn != metric:
        title += f" (no point reported {metric!r})"
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, Path(path))
    return drawn


def save_figure(fig: Any, path: Path) -> None:
    """Write ``fig`` to ``path`` as PNG atomically (a temporary file, a rename); close it."""
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
    ok = [
        p
        for p in points
        if p["status"] == "ok"
        and isinstance(p.get("world"), int)
        and metric_value(p, metric) is not None
    ]
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
    ax.plot(
        worlds,
        [best[w] for w in worlds],
        "o-",
        color="#4C72B0",
        label=f"{metric} (best layout per size)",
    )
    base = worlds[0]
    ax.plot(
        worlds,
        [best[base] * w / base for w in worlds],
        "--",
        color="grey",
        label=f"ideal linear scaling from {base} rank(s)",
    )
    ax.set(
        xscale="log",
        xlabel="ranks (world size)",
        ylabel=metric,
        title=f"{metric} against world size",
    )
    ax.set_xticks(worlds, [str(w) for w in worlds])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, Path(path))
    return True


def render_steps_chart(
    points: list[dict[str, Any]], path: Path | str, metric: str | None = None
) -> str | None:
    """One metric over steps (from each point's ``metrics.jsonl``), one line per point; the metric drawn,
    or None when no point reported progress metrics."""

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
            ax.plot(
                [s for s, _ in steps],
                [v for _, v in steps],
                lw=1.3,
                label=f"job {p['job']}: {p['overrides'] or 'defaults'}"[:60],
            )
    ax.set(xlabel="step", ylabel=drawn, title=f"{drawn} over steps, one line per point")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, Path(path))
    return drawn
