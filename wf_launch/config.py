"""The run's config schema: structured dataclasses in Hydra's ConfigStore.

OmegaConf checks types when a value is set; the dataclasses check values (the
way torchtitan's ``ParallelDims`` validates itself) and raise
:class:`ConfigError` naming the field, the value and what is allowed, before any
process starts. Each launcher's config dataclass lives with its launcher
(:mod:`wf_launch.launchers`); each task's with its task.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from omegaconf import MISSING

from worldfoundry.core.distributed.backends import BACKENDS
from worldfoundry.core.distributed.topology import DIMS, Layout, parse_order

__all__ = ["BACKENDS", "NCCL_BACKENDS", "ConfigError", "EngineConfig", "RunConfig", "TaskConfig", "config_error",
           "normalize_backend", "positive_int"]

NCCL_BACKENDS = tuple(b for b in BACKENDS if "nccl" in b)
MIN_TIMEOUT_MINUTES = 0.001 / 60
"""1 ms: torch rounds a timeout to whole milliseconds, and 0 ms means "fail at once"."""
MAX_TIMEOUT_MINUTES = 7 * 24 * 60
"""A week: longer (or ``inf``) overflows the timedelta torch hands to C++."""
MAX_WORLD_SIZE = 2**31 - 1
"""c10d ranks are 32-bit."""


class ConfigError(ValueError):
    """A config value is not allowed; the message names field, value and what is allowed."""


def config_error(field_name: str, value: Any, allowed: str) -> ConfigError:
    """'FIELD=VALUE is not allowed: ALLOWED', the one shape of every config error."""
    return ConfigError(f"{field_name}={value!r} is not allowed: {allowed}")


def positive_int(name: str, value: Any) -> None:
    """ConfigError unless ``value`` is an integer >= 1 (bools are not integers here)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise config_error(name, value, "expected an integer >= 1")


def normalize_backend(backend: Any) -> str:
    """'cpu:gloo, cuda:nccl' -> 'cpu:gloo,cuda:nccl'; case and spaces do not matter."""
    return str(backend).replace(" ", "").lower()


@dataclass
class EngineConfig:
    """How ranks are laid out and connected (read by ``dist_init``)."""

    distributed_backend: str = "auto"
    distributed_timeout_minutes: float = 30.0
    init_timeout_s: float = 300.0
    tp_size: int = 1
    cp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    order: str = "tp-cp-pp-dp"
    nccl_communicator_config_path: str | None = None

    @classmethod
    def from_dict(cls, engine: Mapping[str, Any]) -> EngineConfig:
        """The engine section as a validated dataclass (unknown keys are an error)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in engine if k not in known)
        if unknown:
            raise config_error(f"engine.{unknown[0]}", engine[unknown[0]], f"no such field; allowed: {sorted(known)}")
        cfg = cls(**{k: engine[k] for k in known if k in engine})
        cfg.validate()
        return cfg

    @property
    def sizes(self) -> dict[str, int]:
        return {d: getattr(self, f"{d}_size") for d in DIMS}

    @property
    def world_size(self) -> int:
        world = 1
        for v in self.sizes.values():
            world *= v
        return world

    @property
    def backend(self) -> str:
        return normalize_backend(self.distributed_backend)

    def validate(self) -> None:
        """Raise :class:`ConfigError` for the first value that is not allowed."""
        if self.backend not in BACKENDS:
            raise config_error("engine.distributed_backend", self.distributed_backend,
                               f"choose one of {list(BACKENDS)}")
        timeout = self.distributed_timeout_minutes
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not MIN_TIMEOUT_MINUTES <= timeout <= MAX_TIMEOUT_MINUTES):
            raise config_error("engine.distributed_timeout_minutes", timeout,
                               f"expected minutes from {MIN_TIMEOUT_MINUTES:.6g} (1 ms) to {MAX_TIMEOUT_MINUTES} "
                               "(a week); fractions allowed, e.g. 0.5")
        init = self.init_timeout_s
        if isinstance(init, bool) or not isinstance(init, (int, float)) or not 1 <= init <= MAX_TIMEOUT_MINUTES * 60:
            raise config_error("engine.init_timeout_s", init, f"expected seconds from 1 to {MAX_TIMEOUT_MINUTES * 60} "
                               "(how long ranks may take to join the process groups)")
        for d in DIMS:
            positive_int(f"engine.{d}_size", getattr(self, f"{d}_size"))
        if self.world_size > MAX_WORLD_SIZE:
            raise config_error("engine.tp_size*cp_size*pp_size*dp_size", self.world_size,
                               f"the world size must be at most {MAX_WORLD_SIZE} ranks (c10d ranks are 32-bit)")
        try:
            parse_order(self.order, self.sizes, self.world_size)
        except ValueError as exc:
            raise config_error("engine.order", self.order,
                               f"a '-'-joined permutation of {'/'.join(DIMS)} ({exc})") from None

    def layout(self) -> Layout:
        """The layout these sizes describe (world size = their product)."""
        return Layout.from_engine(self)


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

    @classmethod
    def build(cls: type[T], task: Mapping[str, Any]) -> T:
        """An instance from the run's ``task`` section (dict or DictConfig); unknown fields are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in task if k not in known)
        if unknown:
            task_name = task.get("name", cls.__name__)
            raise config_error(f"task.{unknown[0]}", task[unknown[0]],
                               f"{task_name} has no such field; allowed fields: {sorted(known - {'name', 'modules'})}")
        values = {k: task[k] for k in known if k in task}
        for key, value in values.items():
            if isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping)):
                values[key] = list(value)
            elif isinstance(value, Mapping):
                values[key] = dict(value)
        return cls(**values)

    @classmethod
    def from_task_config(cls: type[T], task: Mapping[str, Any],
                         engine: EngineConfig | Mapping[str, Any] | None = None) -> T:
        """:meth:`build`, then :meth:`validate` (with the engine when given)."""
        cfg = cls.build(task)
        if engine is not None and not isinstance(engine, EngineConfig):
            engine = EngineConfig.from_dict(engine)
        cfg.validate(engine)
        return cfg


@dataclass
class RunConfig:
    """The whole run: ``engine``, ``launcher`` and ``task``."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    launcher: Any = MISSING
    task: Any = MISSING
