"""Launchers differ only in how rank processes come to exist.

This package is also the one place launcher authors import from: the protocol
(:mod:`.protocol`, the common config and hooks in :mod:`.base`), the registry (:mod:`.registry`: built-ins and the
``wf_launch.launchers`` entry-point group), the plan a launcher receives, what every
rank runs (:class:`RankSpec`, :func:`rank_main`) and the run record it finalizes.
``local`` and ``slurm`` are the built-in launchers, one folder each.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import LauncherConfig, LauncherHooks
from .protocol import DetachedLauncher, Launcher
from .registry import (
    ENTRY_POINT_GROUP,
    get_launcher,
    load_launchers,
    register_launcher,
    registered_launchers,
)

_LAZY = {
    "LaunchPlan": "wf_launch.launchers.launch_plan",
    "RankSpec": "wf_launch.rank.entrypoint",
    "rank_main": "wf_launch.rank.entrypoint",
    "ATTEMPT_ENV": "worldfoundry.core.distributed.env",
    "RunOutcome": "wf_launch.rundir.outcome",
    "RunRecord": "wf_launch.rundir.record",
    "Status": "wf_launch.rundir.record",
    "config_error": "wf_launch.config.fields",
}

__all__ = [
    "ATTEMPT_ENV",
    "ENTRY_POINT_GROUP",
    "DetachedLauncher",
    "LaunchPlan",
    "Launcher",
    "LauncherConfig",
    "LauncherHooks",
    "RankSpec",
    "RunOutcome",
    "RunRecord",
    "Status",
    "config_error",
    "get_launcher",
    "load_launchers",
    "rank_main",
    "register_launcher",
    "registered_launchers",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
