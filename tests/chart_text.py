"""Readability checks for a rendered matplotlib figure, from the extents of its drawn text."""

from __future__ import annotations

from typing import Any

from matplotlib.text import Text


def _undrawn_tick_labels(fig: Any) -> set[int]:
    """Tick labels matplotlib keeps but does not draw (their tick is outside the view)."""
    hidden: set[int] = set()
    for ax in fig.axes:
        for axis, limits in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = sorted(limits)
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not lo - 1e-9 <= tick.get_loc() <= hi + 1e-9:
                    hidden.update({id(tick.label1), id(tick.label2)})
    return hidden


def drawn_texts(fig: Any) -> list[tuple[str, Any]]:
    """(text, window extent in pixels) of every text the figure draws."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    hidden = _undrawn_tick_labels(fig)
    return [
        (t.get_text(), t.get_window_extent(renderer))
        for t in fig.findobj(Text)
        if t.get_visible() and t.get_text().strip() and id(t) not in hidden
    ]


def _overlap(a: Any, b: Any, slack: float = 0.5) -> bool:
    return min(a.x1, b.x1) - max(a.x0, b.x0) > slack and min(a.y1, b.y1) - max(a.y0, b.y0) > slack


def readability_faults(fig: Any) -> list[str]:
    """Every text cut by the figure's edge, and every pair of texts drawn over each other."""
    width, height = fig.bbox.width, fig.bbox.height
    texts = drawn_texts(fig)
    faults = [
        f"cut by the figure's edge: {text!r} at {box.bounds}"
        for text, box in texts
        if box.x0 < -0.5 or box.y0 < -0.5 or box.x1 > width + 0.5 or box.y1 > height + 0.5
    ]
    for i, (text, box) in enumerate(texts):
        faults += [
            f"overlapping: {text!r} and {other!r}"
            for other, other_box in texts[i + 1 :]
            if _overlap(box, other_box)
        ]
    return faults


def figure_texts(fig: Any) -> list[str]:
    return [text for text, _ in drawn_texts(fig)]
