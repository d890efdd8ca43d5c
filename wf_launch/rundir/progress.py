"""The ranks' published progress: ``logs/rank{r}.progress.json``, written and read."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from worldfoundry.core.validation import is_finite_number, is_int

from . import files
from .io import read_json

__all__ = ["plain", "publish_state", "read_progress", "valid_state"]

_MAX_STATE_BYTES = 1 << 20
"""A published state is one small JSON object; a bigger file is not read."""


def plain(value: Any) -> Any:
    """JSON fallback for metric values: a tensor or numpy scalar as its number, else its text."""
    item = getattr(value, "item", None)
    return item() if callable(item) else str(value)


def publish_state(run_dir: Path | str, rank: int, state: dict[str, Any]) -> None:
    """Replace rank ``rank``'s published state atomically (a failed write is dropped: progress is
    advisory)."""
    path = files.rank_progress(run_dir, rank)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(state, default=plain))
        os.replace(tmp, path)
    except OSError:
        pass


def valid_state(state: Any) -> bool:
    """Whether ``state`` is a published progress state the readers can rely on (types of every
    field)."""
    if not isinstance(state, dict) or not (is_int(state.get("step")) and state["step"] >= 0):
        return False
    total, when, pid = state.get("total"), state.get("time"), state.get("pid")
    return (
        (total is None or (is_int(total) and total > 0))
        and (when is None or is_finite_number(when))
        and (pid is None or is_int(pid))
        and isinstance(state.get("metrics", {}), dict)
    )


def read_progress(run_dir: Path | str, world_size: int) -> dict[int, dict[str, Any]]:
    """Every rank's latest published state (ranks that reported nothing yet, or whose state is
    malformed, are absent: progress is advisory)."""
    out = {}
    for rank, path in files.rank_files(run_dir, "progress").items():
        if rank >= world_size:
            break
        try:
            state = read_json(path, _MAX_STATE_BYTES)
        except (OSError, ValueError):
            continue
        if valid_state(state):
            out[rank] = state
    return out
