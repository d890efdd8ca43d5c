"""The run config as a whole: the schema registered with Hydra, and one validation of a composed config.

:class:`RunConfig` is the primary schema (``engine``, ``launcher``, ``task``).

:func:`register_configs` puts every dataclass (engine, each registered launcher's,
each registered task's) into Hydra's ConfigStore; :func:`validate_run_config`
checks a resolved config through the same dataclasses and each launcher's
``validate`` before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from worldfoundry.core.distributed.topology import Layout

from ..launchers import get_launcher, registered_launchers
from ..rank.task_registry import get_task, registered_configs, task_config_class
from .engine import EngineConfig
from .fields import ConfigError, config_error
from .tracking import TrackingConfig

__all__ = ["RunConfig", "register_configs", "validate_run_config"]


@dataclass
class RunConfig:
    """The whole run: ``engine``, ``launcher``, ``task`` and ``tracking``."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    launcher: Any = MISSING
    task: Any = MISSING
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def validate_run_config(cfg: dict[str, Any]) -> Layout:
    """Check a resolved run config (engine, launcher, task); returns the layout. Raises :class:`ConfigError`.

    Each section is checked through its typed dataclass: the engine's, the chosen
    launcher's (common fields, then the launcher's own ``validate``), the task's and the trackers'.
    """
    engine = EngineConfig.from_dict(cfg["engine"])
    layout = engine.layout()
    launcher_section = cfg.get("launcher") or {}
    launcher = get_launcher(str(launcher_section.get("name")))
    launcher_cfg = launcher.config_class.build(launcher_section)
    launcher_cfg.validate(layout.world_size)
    launcher.validate(launcher_cfg, layout, engine)
    task = cfg.get("task") or {}
    if not isinstance(task.get("name"), str) or not task["name"]:
        raise config_error(
            "task.name", task.get("name"), "the name of a registered task (task=NAME)"
        )
    try:
        get_task(task["name"])
    except KeyError as exc:
        raise ConfigError(str(exc.args[0])) from None
    task_config_class(task["name"]).from_task_config(task, engine)
    TrackingConfig.from_dict(cfg.get("tracking"))
    return layout


def _has_yaml(group: str, name: str) -> bool:
    from importlib.resources import files

    try:
        return (files("wf_launch.conf") / group / f"{name}.yaml").is_file()
    except (ModuleNotFoundError, FileNotFoundError):
        return False


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore (the YAML in ``wf_launch/conf/`` builds on it).

    Every registered launcher's config class is stored as ``launcher/NAME_schema``;
    a launcher without a YAML file of its own (a third-party one) is also
    selectable as ``launcher=NAME`` with its dataclass defaults.
    """
    from hydra.core.config_store import ConfigStore  # ranks never pay for importing Hydra

    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="engine", name="engine_schema", node=EngineConfig)
    for name, cls in registered_launchers().items():
        cs.store(group="launcher", name=f"{name}_schema", node=cls.config_class)
        if not _has_yaml("launcher", name):
            cs.store(group="launcher", name=name, node=cls.config_class(name=name))
    for name, node in registered_configs().items():
        cs.store(group="task", name=name, node=node)
