"""``result.json``'s ``placement``: where each rank ran, read back from the ranks' own
``logs/rank{r}.pid``.

Every rank records its pid, host and node when it starts (:mod:`wf_launch.rank.stackdump`); the node
is what its launcher calls it (``WF_NODE``: SLURM's node name, Ray's node id), else the host. The
local and SLURM launchers put this in the record they finalize; the Ray launcher records what its
rank actors reported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import files
from .io import read_json

__all__ = ["read_placement"]


def read_placement(run_dir: Path | str, world_size: int) -> dict[str, dict[str, Any]]:
    """``{rank: {"host", "node", "pid"}}`` for every rank that recorded where it ran (its latest
    attempt)."""
    out: dict[str, dict[str, Any]] = {}
    for rank in range(world_size):
        try:
            info = read_json(files.rank_pid(run_dir, rank))
        except (OSError, ValueError):
            continue
        if isinstance(info, dict):
            out[str(rank)] = {
                "host": info.get("host"),
                "node": info.get("node") or info.get("host"),
                "pid": info.get("pid"),
            }
    return out
