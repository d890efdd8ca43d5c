"""The ``task`` section's base: which registered task every rank runs, and its typed fields."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol, TypeVar

from omegaconf import MISSING

from worldfoundry.core.distributed.topology import Layout

from .engine import EngineConfig
from .fields import unknown_field

__all__ = ["PlanView", "TaskConfig"]


class PlanView(Protocol):
    """What a task's dry-run text reads of the launch plan.

    The plan (:class:`~wf_launch.launchers.launch_plan.LaunchPlan`) is made a floor above, by the
    app, once the launchers' registry has typed its ``launcher`` section.
    """

    config: dict[str, Any]
    layout: Layout
    run_dir: Path

    @property
    def world_size(self) -> int: ...

    @property
    def launcher_config(self) -> Any: ...


T = TypeVar("T", bound="TaskConfig")


@dataclass
class TaskConfig:
    """Which registered task every rank runs; ``modules`` are imported first (user tasks).

    Subclass it to give a task typed fields with defaults: the instance reaches
    the task as ``ctx.cfg``. Override :meth:`validate` to check values; it runs in
    the launcher before any process starts.
    """

    name: str = MISSING
    modules: list[str] = field(default_factory=list)

    def validate(self, engine: EngineConfig | None = None) -> None:
        """Raise :class:`ConfigError` naming field, value and what is allowed.

        ``engine`` is the run's engine config in the launcher (check the fit of
        the task with the layout there), and None elsewhere.
        """

    def describe(self, plan: PlanView) -> str:
        """What the dry run (``launcher.dry_run=true``) adds about the task, e.g. the command each
        rank runs (``task=script``); nothing by default."""
        return ""

    @classmethod
    def build(cls: type[T], task: Mapping[str, Any]) -> T:
        """An instance from the run's ``task`` section (dict or DictConfig); unknown fields are an
        error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in task if k not in known)
        if unknown:
            task_name = task.get("name", cls.__name__)
            raise unknown_field(
                f"task.{unknown[0]}", task[unknown[0]], known - {"name", "modules"}, owner=task_name
            )
        values = {k: task[k] for k in known if k in task}
        for key, value in values.items():
            if isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping)):
                values[key] = list(value)
            elif isinstance(value, Mapping):
                values[key] = dict(value)
        return cls(**values)

    @classmethod
    def from_task_config(
        cls: type[T],
        task: Mapping[str, Any],
        engine: EngineConfig | Mapping[str, Any] | None = None,
    ) -> T:
        """:meth:`build`, then :meth:`validate` (with the engine when given)."""
        cfg = cls.build(task)
        if isinstance(engine, Mapping):
            engine = EngineConfig.from_dict(engine)
        cfg.validate(engine)
        return cfg
