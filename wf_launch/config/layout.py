"""A resolved config's parallel layout, and how a rank is named by it ('r5 tp0 cp1 pp1 dp0')."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worldfoundry.core.distributed.topology import DIMS, Layout

__all__ = ["layout_of", "rank_label"]


def layout_of(config: Mapping[str, Any]) -> Layout:
    """The layout a resolved config (its ``engine`` section) describes; world size = product of the sizes."""
    return Layout.from_engine(config["engine"])


def rank_label(rank: int, coords: Mapping[str, int]) -> str:
    """'r5 tp0 cp1 pp1 dp0': a rank and its layout coordinates."""
    return f"r{rank} " + " ".join(f"{d}{coords[d]}" for d in DIMS)
