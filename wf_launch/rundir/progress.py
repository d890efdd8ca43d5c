"""The ranks' published progress: ``logs/rank{r}.progress.json``, written and read."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from . import files

__all__ = ["plain", "publish_state", "read_progress"]


def plain(value: Any) -> Any:
    """JSON fallback for metric values: a tensor or numpy scalar as its number, else its text."""
    item = getattr(value, "item", None)
    return item() if callable(item) else str(value)


def publish_state(run_dir: Path | str, rank: int, state: dict[str, Any]) -> None:
    """Replace rank ``rank``'s published state atomically (a failed write is dropped: progress is advisory)."""
    path = files.rank_progress(run_dir, rank)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(state, default=plain))
        os.replace(tmp, path)
    except OSError:
        pass


def read_progress(run_dir: Path | str, world_size: int) -> dict[int, dict[str, Any]]:
    """Every rank's latest published state (ranks that reported nothing yet are absent)."""
    out = {}
    for rank in range(world_size):
        try:
            state = json.loads(files.rank_progress(run_dir, rank).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(state, dict) and isinstance(state.get("step"), int):
            out[rank] = state
    return out
