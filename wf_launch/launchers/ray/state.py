"""``ray_run.json``: what a Ray run records about itself (where, who monitors it, its state,
each rank's node and pid), merged field by field, for the tools that read it meanwhile.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...rundir import files
from ...rundir.io import atomic_write_json, read_json


def read(run_dir: Path | str) -> dict[str, Any] | None:
    """The run's ``ray_run.json`` (None when it has none, or it is unreadable)."""
    try:
        data = read_json(Path(run_dir) / files.RAY_RUN)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def update(run_dir: Path | str, **fields: Any) -> None:
    """Merge ``fields`` into the run's ``ray_run.json``."""
    atomic_write_json(Path(run_dir) / files.RAY_RUN, {**(read(run_dir) or {}), **fields})


def record_placement(where: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """rank -> node, host, ip, pid ... as ``result.json``'s ``placement``."""
    keys = ("host", "node", "pid", "ip")
    return {str(r): {k: w.get(k) for k in keys} for r, w in sorted(where.items())}


def placement_of(run_dir: Path | str) -> dict[int, dict[str, Any]]:
    """The current attempt's placement, by rank (empty before the ranks are placed)."""
    raw = (read(run_dir) or {}).get("placement") or {}
    return {int(r): p for r, p in raw.items() if isinstance(p, dict) and str(r).isdigit()}


def where_of(run_dir: Path | str) -> dict[int, tuple[str, int]]:
    """rank -> (node id, pid) of the current attempt, for :func:`~.rank_entry.signal_ranks`."""
    return {
        r: (str(p["node"]), int(p["pid"]))
        for r, p in placement_of(run_dir).items()
        if p.get("node") and p.get("pid")
    }
