"""The run config as a whole: :class:`RunConfig`, the primary schema Hydra composes.

The registries of launchers and tasks sit above this floor: the CLI stores every registered
launcher's and task's dataclass beside it (:func:`wf_launch.cli.register_configs`), and the app
checks a composed config through them (:func:`wf_launch.app.validate_run_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from .engine import EngineConfig
from .ft import FtConfig
from .tracking import TrackingConfig

__all__ = ["RunConfig"]


@dataclass
class RunConfig:
    """The whole run: ``engine``, ``launcher``, ``task``, ``tracking`` and ``ft``."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    launcher: Any = MISSING
    task: Any = MISSING
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    ft: FtConfig = field(default_factory=FtConfig)
