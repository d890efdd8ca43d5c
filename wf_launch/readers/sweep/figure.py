"""What every chart of a sweep or a tune needs: labels that fit, legends kept whole, atomic PNGs.

A chart's text is laid out by measuring it: the figure is widened until the labels along
the x axis (and the values written over the bars) stand apart, and beyond a width a reader
can still take in, the tick labels turn upright instead. matplotlib is imported by the
callers (the charts), never at import time here: it is optional and slow to import.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import textwrap
from pathlib import Path
from typing import Any

__all__ = ["MAX_WIDTH_IN", "fit_width", "legend_below", "save_png", "wrap_label"]

MAX_WIDTH_IN = 18.0
"""The widest figure drawn (inches); past it the x tick labels are drawn upright."""
GAP_PX = 6.0
"""The least room between two texts side by side (pixels)."""


def wrap_label(text: str, width: int = 48) -> str:
    """``text`` over as many lines as it needs, no line wider than ``width`` characters."""
    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=False)) or text


def _boxes(fig: Any, texts: list[Any]) -> list[Any]:
    renderer = fig.canvas.get_renderer()
    shown = [t for t in texts if t.get_visible() and t.get_text().strip()]
    return sorted((t.get_window_extent(renderer) for t in shown), key=lambda b: b.x0)


def _stretch_needed(fig: Any, texts: list[Any]) -> float:
    """How much wider the axes must be for side-by-side ``texts`` not to touch (1.0: enough)."""
    boxes = _boxes(fig, texts)
    need = 1.0
    for a, b in itertools.pairwise(boxes):
        if a.y1 < b.y0 or b.y1 < a.y0:
            continue
        apart = (b.x0 + b.x1) / 2 - (a.x0 + a.x1) / 2
        wanted = (a.width + b.width) / 2 + GAP_PX
        if apart <= 0:
            need = max(need, 4.0)
        elif apart < wanted:
            need = max(need, wanted / apart)
    return need


def fit_width(fig: Any, ax: Any, texts: list[Any] | None = None) -> None:
    """Lay ``fig`` out so that ``ax``'s x tick labels and ``texts`` (e.g. values over bars) stand
    apart.

    The figure is widened as far as :data:`MAX_WIDTH_IN`; past it the tick labels are drawn
    upright on one line each, and the figure is widened again for those.
    """
    groups = [list(ax.get_xticklabels()), list(texts or [])]
    for _ in range(2):
        for _ in range(6):
            fig.tight_layout()
            need = max(_stretch_needed(fig, group) for group in groups)
            if need <= 1.0:
                return
            width, height = fig.get_size_inches()
            axes_in = ax.get_position().width * width
            wanted = width + axes_in * (need - 1.0) * 1.05
            if wanted > MAX_WIDTH_IN:
                break
            fig.set_size_inches(wanted, height)
        _upright(ax)
    fig.set_size_inches(MAX_WIDTH_IN, fig.get_size_inches()[1])
    fig.tight_layout()


def _upright(ax: Any) -> None:
    for label in ax.get_xticklabels():
        label.set_text(label.get_text().replace("\n", " "))
        label.set_rotation(90)
    ax.set_xticks(ax.get_xticks(), [t.get_text() for t in ax.get_xticklabels()], rotation=90)


def legend_below(fig: Any, ax: Any, fontsize: float = 7.5) -> Any:
    """The axes' legend under the plot and its axis label, as many columns as fit, the figure made
    taller for it: never cut, never over the lines. ``fig`` uses the constrained layout."""
    handles, labels = ax.get_legend_handles_labels()
    columns = min(1 if max((len(s) for s in labels), default=0) > 40 else 2, max(1, len(labels)))
    lines = sum(label.count("\n") + 1 for label in labels)
    width, height = fig.get_size_inches()
    fig.set_size_inches(width, height + (lines / columns + 1) * fontsize * 1.5 / 72)
    return fig.legend(
        handles,
        labels,
        fontsize=fontsize,
        loc="outside lower center",
        ncols=columns,
        frameon=False,
    )


def save_png(fig: Any, path: Path) -> None:
    """Write ``fig`` to ``path`` atomically (a temporary file beside it, then a rename), then close
    it."""
    import matplotlib.pyplot as plt  # optional and slow to import: only where a chart is drawn

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        Path(tmp).unlink(missing_ok=True)
