"""Launchers differ only in how rank processes come to exist.

:mod:`.base` defines the :class:`~.base.Launcher` protocol, :mod:`.registry` finds
launchers (built-ins and the ``wf_launch.launchers`` entry-point group); ``local``
and ``slurm`` are the built-in ones.
"""

from __future__ import annotations

from .base import DetachedLauncher, Launcher, LauncherConfig
from .registry import ENTRY_POINT_GROUP, get_launcher, load_launchers, register_launcher, registered_launchers

__all__ = ["ENTRY_POINT_GROUP", "DetachedLauncher", "Launcher", "LauncherConfig", "get_launcher",
           "load_launchers", "register_launcher", "registered_launchers"]
