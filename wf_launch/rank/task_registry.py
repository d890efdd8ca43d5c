"""Task registry: ``@register_task("name")`` and lookup by name, one :class:`TaskSpec` per task.

Built-in tasks live in this package; user tasks come from modules named in the
config (``task.module=my_pkg.tasks``) or from the ``wf_launch.tasks`` entry-point
group (each entry point names a module to import, whose import registers tasks).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from ..config import TaskConfig

__all__ = [
    "ENTRY_POINT_GROUP",
    "TaskSpec",
    "get_task",
    "load_task_modules",
    "register_task",
    "registered_configs",
    "task_config_class",
    "task_owns_group",
    "task_preload",
    "task_spec",
    "task_supports_ft",
]

TaskFn = Callable[[Any], dict[str, Any] | None]


@dataclass(frozen=True)
class TaskSpec:
    """One registered task: its function and what :func:`register_task` was told about it.

    ``config`` None means a plain :class:`~wf_launch.config.TaskConfig`.
    """

    name: str
    fn: TaskFn
    config: type | None = None
    preload: tuple[str, ...] = ()
    own_group: bool = False
    ft: bool = False


_SPECS: dict[str, TaskSpec] = {}
_BUILTINS = {
    "demo": "wf_launch.tasks.demo",
    "layout": "wf_launch.tasks.layout",
    "noop": "wf_launch.tasks.noop",
    "train": "wf_launch.tasks.train",
    "script": "wf_launch.tasks.script",
    "call": "wf_launch.tasks.call",
}
ENTRY_POINT_GROUP = "wf_launch.tasks"


def register_task(
    name: str,
    config: type | None = None,
    preload: Iterable[str] = (),
    own_group: bool = False,
    ft: bool = False,
) -> Callable[[TaskFn], TaskFn]:
    """Register ``fn(ctx) -> dict`` as task ``name`` (selected with ``task=name``).

    ``config`` is an optional dataclass subclassing
    :class:`wf_launch.config.TaskConfig`: it becomes the Hydra schema of
    ``task=name``, its ``validate(engine)`` runs in the launcher before any
    process starts, and the task receives the instance as ``ctx.cfg``. Without
    one the task takes a plain TaskConfig. (A ``validate_config(task, engine)``
    attribute on ``fn``, the older way, is still called with both sections.)

    ``preload`` names heavy modules every rank of the task imports anyway (DCP,
    torch's dynamo for FSDP2: about 1 s per rank): the local launcher imports
    them once before it forks the ranks, which then inherit them, as gunicorn's
    preload does. Importing must not start threads or touch CUDA; if it does, the
    launcher falls back to spawn (``launcher.start_method=auto``).

    ``own_group=True``: the task starts its own process group (``task=script``,
    ``task=call``: code written for torchrun). The entrypoint then runs it without
    ``dist_init`` and with no groups in ``ctx``, tears down whatever group it left, and
    gathers the ranks' results through the run directory instead of a collective.

    ``ft=True``: the task runs under ``ft=torchft`` (fault-tolerant replica groups): it steps
    through ``ctx.ft``, torchft's Manager (docs/fault-tolerance.md). Other tasks are refused there.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"register_task: task name must be a non-empty string, got {name!r}")

    if config is not None and not (isinstance(config, type) and issubclass(config, TaskConfig)):
        raise ValueError(
            f"register_task({name!r}): config={config!r} must be a dataclass subclassing "
            "wf_launch.config.TaskConfig"
        )

    modules = (preload,) if isinstance(preload, str) else tuple(preload)
    if not all(isinstance(m, str) and m.strip() for m in modules):
        raise ValueError(f"register_task({name!r}): preload={preload!r} must be module names")

    def deco(fn: TaskFn) -> TaskFn:
        known = _SPECS.get(name)
        existing = None if known is None else known.fn
        if (
            existing is not None
            and existing is not fn
            and (existing.__module__, existing.__qualname__) != (fn.__module__, fn.__qualname__)
        ):
            raise ValueError(
                f"task {name!r} is already registered by "
                f"{existing.__module__}.{existing.__qualname__}"
            )
        _SPECS[name] = TaskSpec(name, fn, config, modules, own_group, ft)
        return fn

    return deco


def load_task_modules(modules: Iterable[str] = (), builtins: bool = True) -> None:
    """Import entry-point modules and ``modules`` (and the built-in tasks) so their tasks register.

    Ranks pass ``builtins=False``: :func:`get_task` imports a built-in task's module
    only when that task is asked for.
    """
    if builtins:
        for mod in _BUILTINS.values():
            importlib.import_module(mod)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as exc:
            raise ImportError(
                f"entry point {ep.name!r} = {ep.value!r} in group "
                f"{ENTRY_POINT_GROUP!r} failed to load: {exc}"
            ) from exc
    for mod in modules:
        try:
            importlib.import_module(mod)
        except ImportError as exc:
            raise ImportError(f"task.modules: cannot import {mod!r}: {exc}") from exc


def task_spec(name: str) -> TaskSpec:
    """The record of task ``name`` (importing a built-in's module); KeyError lists the names."""
    if name not in _SPECS and name in _BUILTINS:
        importlib.import_module(_BUILTINS[name])
    try:
        return _SPECS[name]
    except KeyError:
        raise KeyError(
            f"task.name={name!r} is not registered; registered tasks: {sorted(_SPECS)}"
        ) from None


def get_task(name: str) -> TaskFn:
    """The task registered as ``name``; KeyError lists the registered names."""
    return task_spec(name).fn


def task_config_class(name: str) -> type:
    """The config dataclass of task ``name``: its own, else a plain ``TaskConfig``."""

    return task_spec(name).config or TaskConfig


def registered_configs() -> dict[str, Any]:
    """A config node for every registered task: its own dataclass, else a plain TaskConfig."""
    return {name: task_config_class(name)(name=name) for name in _SPECS}


def task_preload(name: str) -> tuple[str, ...]:
    """The modules task ``name`` asked the launcher to import before forking its ranks."""
    if name not in _SPECS and name in _BUILTINS:
        importlib.import_module(_BUILTINS[name])
    spec = _SPECS.get(name)
    return () if spec is None else spec.preload


def task_owns_group(name: str) -> bool:
    """Whether task ``name`` starts its own process group (``register_task(own_group=True)``)."""
    return task_spec(name).own_group


def task_supports_ft(name: str) -> bool:
    """Whether task ``name`` steps through torchft's Manager (``register_task(ft=True)``)."""
    return task_spec(name).ft
