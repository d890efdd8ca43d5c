"""``tune_chart.png``: the metric of every measured layout in every round it ran (median,
quartiles).

Its title is its caption: it names the metric drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...readers.sweep.figure import fit_width, save_png
from .measure import Measurement
from .state import TuneState, order_points

__all__ = ["caption", "chart_figure", "render_chart"]

_COLORS = ("#9DB4D6", "#4C72B0", "#2A4D8F", "#55A868", "#C9A227", "#8172B2", "#937860")


def caption(state: TuneState) -> str:
    """What the chart shows, as its title says it."""
    pruned = sum(p["verdict"]["status"] != "valid" for p in state.space)
    return (
        f"{state.args['metric']} per layout per round (median, quartiles); "
        f"{pruned} point(s) pruned before running"
    )


def _tick_label(point: dict[str, Any], winner: str | None) -> str:
    """The layout on one line, then each ``--also`` value on its own."""
    sizes = "·".join(f"{d}{n}" for d, n in point["sizes"].items())
    also = [f"{k.rpartition('.')[2]}={v}" for k, v in point["also"].items()]
    return "\n".join([("★ " if point["id"] == winner else "") + sizes, *also])


class _RoundBars:
    """One round's bars: x offsets, medians, quartile whiskers, and the trials that failed."""

    def __init__(self, width: float) -> None:
        self.width = width
        self.xs: list[float] = []
        self.ys: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.bad: list[float] = []

    def add(self, x: float, m: Measurement) -> None:
        if m.ok:
            self.xs.append(x)
            self.ys.append(m.value)
            self.lo.append(max(0.0, m.value - (m.p25 if m.p25 is not None else m.value)))
            self.hi.append(max(0.0, (m.p75 if m.p75 is not None else m.value) - m.value))
        elif m.status != "not_run":
            self.bad.append(x)

    def draw(self, ax: Any, color: str, label: str, first: bool) -> None:
        ax.bar(
            self.xs,
            self.ys,
            width=self.width,
            color=color,
            edgecolor="black",
            linewidth=0.4,
            yerr=[self.lo, self.hi],
            capsize=2,
            error_kw={"linewidth": 0.7},
            label=label,
        )
        if self.bad:
            ax.scatter(
                self.bad,
                [0] * len(self.bad),
                marker="x",
                color="#C44E52",
                zorder=3,
                label="failed / stalled" if first else None,
            )


def chart_figure(state: TuneState) -> Any:
    """Grouped bars: a group per measured layout (best first), a bar per round, whiskers p25..p75.

    The winner's label is starred; failed trials are a red ``x`` at the axis.
    """
    import matplotlib  # optional, and seconds to import: only when the chart is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = {d["trial"] for d in state.measurements}
    points = [p for p in order_points(state) if p["id"] in measured]
    by = {(d["trial"], d["round"]): Measurement.from_json(d) for d in state.measurements}
    rounds = state.rounds
    width = 0.8 / max(1, len(rounds))
    fig, ax = plt.subplots(figsize=(max(7.0, 0.55 * len(points) + 2), 4.8), dpi=110)
    for j, rec in enumerate(rounds):
        bars = _RoundBars(width)
        for i, p in enumerate(points):
            m = by.get((p["id"], rec["index"]))
            if m is not None:
                bars.add(i + (j - (len(rounds) - 1) / 2) * width, m)
        label = f"round {rec['index']} ({rec['steps']} steps)"
        bars.draw(ax, _COLORS[j % len(_COLORS)], label, j == 0)
    ax.set_xticks(range(len(points)), [_tick_label(p, state.winner) for p in points], fontsize=7)
    ax.set_ylabel(state.args["metric"])
    ax.set_title(caption(state), fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fit_width(fig, ax)
    return fig


def render_chart(state: TuneState, path: Path) -> None:
    """Draw :func:`chart_figure` into ``path`` (atomically)."""
    save_png(chart_figure(state), path)
