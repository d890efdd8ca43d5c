"""Launchers differ only in how rank processes come to exist.

This package is also the one place launcher authors import from: the protocol
(:mod:`.protocol`; the common config and the hooks' defaults in :mod:`.base`), the registry
(:mod:`.registry`: built-ins and the ``wf_launch.launchers`` entry-point group), the plan a
launcher receives, what every rank runs (:class:`RankSpec`, :func:`rank_main`) and the run
record it finalizes. ``local``, ``slurm`` and ``ray`` are the built-in launchers, one folder
each.
"""

from __future__ import annotations

from worldfoundry.core.distributed.env import ATTEMPT_ENV

from ..config.fields import config_error
from ..rank.entrypoint import RankSpec, rank_main
from ..rundir.outcome import RunOutcome
from ..rundir.record import RunRecord, Status
from .base import LauncherConfig, LauncherHooks
from .launch_plan import LaunchPlan
from .protocol import DetachedLauncher, Launcher
from .registry import (
    ENTRY_POINT_GROUP,
    get_launcher,
    load_launchers,
    register_launcher,
    registered_launchers,
)

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
