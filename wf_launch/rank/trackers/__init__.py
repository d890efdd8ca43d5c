"""Experiment trackers in the rank: ``tracking=tensorboard|mlflow|wandb`` (a list for several).

Rank 0 (every rank with ``tracking.all_ranks``, each under its own name) feeds its
``ctx.progress`` metrics, the run's config and each attempt's end to the selected trackers
through a :class:`~.hub.TrackerHub`. One module per tracker; each continues the same tracked run
in every attempt of the run (see :mod:`.hub`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from ...config.redact import redact_config
from ...config.tracking import enabled_trackers
from .base import STATUSES, Tracker, TrackerSettings
from .hub import TrackerHub, read_state

__all__ = [
    "IMPLEMENTATIONS",
    "STATUSES",
    "Tracker",
    "TrackerHub",
    "TrackerSettings",
    "open_trackers",
]

IMPLEMENTATIONS = {
    "tensorboard": "wf_launch.rank.trackers.tensorboard_tracker:TensorBoardTracker",
    "mlflow": "wf_launch.rank.trackers.mlflow_tracker:MLflowTracker",
    "wandb": "wf_launch.rank.trackers.wandb_tracker:WandbTracker",
}


def _implementation(name: str) -> type[Tracker]:
    module, _, cls = IMPLEMENTATIONS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def open_trackers(
    config: dict[str, Any], run_dir: Path | str, rank: int, run_id: str, attempt: int, log: Any
) -> TrackerHub | None:
    """The hub of this rank's trackers, started (None when the run tracks nothing on this rank).

    The libraries are imported on the hub's thread, never on the caller's.
    """
    section = config.get("tracking") or {}
    names = enabled_trackers(section)
    tagged = bool(section.get("all_ranks"))
    if not names or (rank != 0 and not tagged):
        return None
    trackers = []
    for name in names:
        settings = TrackerSettings(
            run_dir=Path(run_dir),
            run_id=run_id,
            rank=rank,
            attempt=attempt,
            tagged=tagged,
            config=redact_config(config),
            section=dict(section.get(name) or {}),
            state=read_state(run_dir, name, rank),
        )
        trackers.append(_implementation(name)(settings))
    return TrackerHub(
        trackers,
        run_dir,
        rank,
        log,
        flush_s=float(section.get("flush_s", 1.0)),
        close_timeout_s=float(section.get("close_timeout_s", 30.0)),
    )
