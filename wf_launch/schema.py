"""The run config as a whole: the schema registered with Hydra, and one validation of a composed config.

:func:`register_configs` puts every dataclass (engine, each registered launcher's,
each registered task's) into Hydra's ConfigStore; :func:`validate_run_config`
checks a resolved config through the same dataclasses and each launcher's
``validate`` before any process starts.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from worldfoundry.core.distributed.topology import Layout

from .config import ConfigError, EngineConfig, RunConfig, TaskConfig, config_error
from .launchers import get_launcher, registered_launchers
from .launchers.base import validate_common
from .tasks.registry import get_task, registered_configs, task_config_class

__all__ = ["register_configs", "validate_run_config"]


def validate_run_config(cfg: dict[str, Any]) -> Layout:
    """Check a resolved run config (engine, launcher, task); returns the layout. Raises :class:`ConfigError`."""
    engine = EngineConfig.from_dict(cfg["engine"])
    layout = engine.layout()
    launcher_cfg = cfg.get("launcher") or {}
    launcher = get_launcher(str(launcher_cfg.get("name")))
    known = {f.name for f in fields(launcher.config_class)}
    unknown = sorted(str(k) for k in launcher_cfg if k not in known)
    if unknown:
        raise config_error(f"launcher.{unknown[0]}", launcher_cfg[unknown[0]],
                           f"launcher={launcher.name} has no such field; its fields: {sorted(known)}")
    validate_common(launcher_cfg, layout.world_size)
    launcher.validate(launcher_cfg, layout, cfg["engine"])
    task = cfg.get("task") or {}
    if not isinstance(task.get("name"), str) or not task["name"]:
        raise config_error("task.name", task.get("name"), "the name of a registered task (task=NAME)")
    try:
        fn = get_task(task["name"])
    except KeyError as exc:
        raise ConfigError(str(exc.args[0])) from None
    cls = task_config_class(task["name"])
    cls.from_task_config(task, engine)
    legacy = getattr(fn, "validate_config", None)
    if legacy is not None and cls is TaskConfig:
        legacy(task, cfg["engine"])
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
    cs.store(group="task", name="task_schema", node=TaskConfig)
    for name, node in registered_configs().items():
        cs.store(group="task", name=name, node=node)
