"""``tune_chart.png``: the metric of every measured layout in every round it ran (median and quartiles)."""

from __future__ import annotations

from pathlib import Path

from ...readers.sweep.charts import save_figure
from .measure import Measurement
from .state import TuneState, order_points

__all__ = ["render_chart"]

_COLORS = ("#9DB4D6", "#4C72B0", "#2A4D8F", "#55A868", "#C9A227", "#8172B2", "#937860")


def render_chart(state: TuneState, path: Path) -> None:
    """Grouped bars: one group per measured layout (best first), one bar per round, error bars from p25 to p75.

    The winner's label is marked; failed trials are a red ``x`` at the axis.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = state.args["metric"]
    points = [
        p for p in order_points(state) if any(d["trial"] == p["id"] for d in state.measurements)
    ]
    rounds = [r["index"] for r in state.rounds]
    by = {(d["trial"], d["round"]): Measurement.from_json(d) for d in state.measurements}
    width = 0.8 / max(1, len(rounds))
    fig, ax = plt.subplots(figsize=(max(7.0, 0.55 * len(points) + 2), 4.8), dpi=110)
    for j, r in enumerate(rounds):
        xs, ys, lo, hi, bad = [], [], [], [], []
        for i, p in enumerate(points):
            m = by.get((p["id"], r))
            if m is None:
                continue
            x = i + (j - (len(rounds) - 1) / 2) * width
            if m.ok:
                xs.append(x)
                ys.append(m.value)
                lo.append(max(0.0, m.value - (m.p25 if m.p25 is not None else m.value)))
                hi.append(max(0.0, (m.p75 if m.p75 is not None else m.value) - m.value))
            elif m.status != "not_run":
                bad.append(x)
        color = _COLORS[j % len(_COLORS)]
        steps = next(rec["steps"] for rec in state.rounds if rec["index"] == r)
        ax.bar(
            xs,
            ys,
            width=width,
            color=color,
            edgecolor="black",
            linewidth=0.4,
            yerr=[lo, hi],
            capsize=2,
            error_kw={"linewidth": 0.7},
            label=f"round {r} ({steps} steps)",
        )
        if bad:
            ax.scatter(
                bad,
                [0] * len(bad),
                marker="x",
                color="#C44E52",
                zorder=3,
                label="failed / stalled" if j == 0 else None,
            )
    labels = [
        ("★ " if p["id"] == state.winner else "") + p["label"].replace(" ", "\n") for p in points
    ]
    ax.set_xticks(range(len(points)), labels, fontsize=7)
    ax.set_ylabel(metric)
    pruned = sum(p["verdict"]["status"] != "valid" for p in state.space)
    ax.set_title(
        f"{metric} per layout per round (median, quartiles); {pruned} point(s) pruned before running",
        fontsize=10,
    )
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
