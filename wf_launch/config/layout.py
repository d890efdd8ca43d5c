"""A resolved config's parallel layout, and how a rank is named by it ('r5 tp0 cp1 pp1 dp0')."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worldfoundry.core.distributed.topology import DIMS, Layout

__all__ = ["MAX_READ_WORLD", "layout_of", "rank_label", "run_layout"]

MAX_READ_WORLD = 1 << 20
"""The largest world a tool reads from a run directory's config (status, follow, stacks): more is a
corrupt file."""


def layout_of(config: Mapping[str, Any]) -> Layout:
    """The layout a resolved config (its ``engine`` section) describes; world size = product of the
    sizes."""
    return Layout.from_engine(config["engine"])


def run_layout(config: Any) -> Layout:
    """The layout of a config read back from a run directory; ValueError saying what is wrong with
    it.

    The tools that read a run loop over its ranks, so a world larger than
    :data:`MAX_READ_WORLD` is refused as a corrupt file rather than looped over.
    """
    engine = config.get("engine") if isinstance(config, Mapping) else None
    if not isinstance(engine, Mapping):
        raise ValueError(f"its config has no engine section (found {type(engine).__name__})")
    try:
        layout = Layout.from_engine(engine)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"its config's layout is not valid: {exc}") from None
    if layout.world_size > MAX_READ_WORLD:
        raise ValueError(
            f"its config's world size {layout.world_size} is more than the {MAX_READ_WORLD} ranks "
            "a tool reads back"
        )
    return layout


def rank_label(rank: int, coords: Mapping[str, int]) -> str:
    """'r5 tp0 cp1 pp1 dp0': a rank and its layout coordinates."""
    return f"r{rank} " + " ".join(f"{d}{coords[d]}" for d in DIMS)
