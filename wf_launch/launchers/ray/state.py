"""``ray_run.json``: what a Ray run recorded about itself, for the tools that read it while or after
it runs.

Written (atomically, merged field by field) by whoever runs the run's monitor, the launching
command (``launcher.wait=true``) or the run's supervisor actor (``wait=false``, sweeps):

``address`` (the cluster's GCS address), ``namespace`` and ``supervisor`` (the supervisor
actor's name, null when the launching command monitors the run itself), ``detached``,
``private`` (a private instance, gone with the run), ``world_size``, ``nodes``,
``started_at``, ``launcher_pid`` / ``launcher_host`` (the launching command), ``state``
(``placing``, ``starting``, ``running``, ``restarting``, ``stopping``, ``ended``) with
``attempt``, and ``placement``: per rank ``host``, ``node`` (Ray node id), ``pid``, ``ip``
of the current attempt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...rundir import files
from ...rundir.io import atomic_write_json, read_json

__all__ = ["RUN_FILE", "placement_of", "read", "record_placement", "update", "where_of"]

RUN_FILE = files.RAY_RUN


def read(run_dir: Path | str) -> dict[str, Any] | None:
    """The run's ``ray_run.json`` (None when it has none, or it is unreadable)."""
    try:
        data = read_json(Path(run_dir) / RUN_FILE)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def update(run_dir: Path | str, **fields: Any) -> dict[str, Any]:
    """Merge ``fields`` into the run's ``ray_run.json`` (written atomically); the new content."""
    data = {**(read(run_dir) or {}), **fields}
    atomic_write_json(Path(run_dir) / RUN_FILE, data)
    return data


def record_placement(where: dict[int, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``where`` answers (rank -> node, host, ip, pid ...) as ``result.json``'s ``placement``."""
    return {
        str(r): {
            "host": w.get("host"),
            "node": w.get("node"),
            "pid": w.get("pid"),
            "ip": w.get("ip"),
        }
        for r, w in sorted(where.items())
    }


def placement_of(run_dir: Path | str) -> dict[int, dict[str, Any]]:
    """The current attempt's placement, by rank (empty before the ranks are placed)."""
    raw = (read(run_dir) or {}).get("placement") or {}
    return {int(r): p for r, p in raw.items() if isinstance(p, dict) and str(r).isdigit()}


def where_of(run_dir: Path | str) -> dict[int, tuple[str, int]]:
    """rank -> (node id, pid) of the current attempt, for :func:`~.reach.signal_ranks`."""
    return {
        r: (str(p["node"]), int(p["pid"]))
        for r, p in placement_of(run_dir).items()
        if p.get("node") and p.get("pid")
    }
