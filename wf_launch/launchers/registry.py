"""The launcher registry: built-in launchers and third-party ones from entry points.

``register_launcher`` (a class decorator) adds a :class:`~.protocol.Launcher`;
``get_launcher(name)`` returns an instance. Third-party packages register theirs
through the entry-point group :data:`ENTRY_POINT_GROUP`: each entry point names
a launcher class, or a module whose import registers one.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any, TypeVar

from ..config.fields import config_error
from .base import LauncherConfig, with_hooks

__all__ = [
    "ENTRY_POINT_GROUP",
    "get_launcher",
    "load_launchers",
    "register_launcher",
    "registered_launchers",
]

ENTRY_POINT_GROUP = "wf_launch.launchers"
_BUILTINS = {
    "local": "wf_launch.launchers.local",
    "slurm": "wf_launch.launchers.slurm",
    "ray": "wf_launch.launchers.ray",
}
_REGISTRY: dict[str, type] = {}
_LOADED = False

L = TypeVar("L", bound=type)


def register_launcher(cls: L) -> L:
    """Register launcher class ``cls`` under ``cls.name`` (selected with ``launcher=NAME``).

    What is registered has every optional hook of :class:`~.base.LauncherHooks` (its defaults
    mixed in when ``cls`` does not subclass it); ``cls`` itself is returned unchanged.
    """
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.strip():
        raise ValueError(
            f"register_launcher: {cls!r} needs a class attribute 'name' (a non-empty string)"
        )
    config = getattr(cls, "config_class", None)
    if not (isinstance(config, type) and issubclass(config, LauncherConfig)):
        raise ValueError(
            f"register_launcher: {cls.__qualname__}.config_class must subclass "
            "wf_launch.launchers.LauncherConfig"
        )
    missing = [m for m in ("validate", "describe", "launch") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"register_launcher: {cls.__qualname__} lacks {missing}")
    existing = _REGISTRY.get(name)
    if existing is not None and (existing.__module__, existing.__qualname__) != (
        cls.__module__,
        cls.__qualname__,
    ):
        raise ValueError(
            f"launcher {name!r} is already registered by "
            f"{existing.__module__}.{existing.__qualname__}"
        )
    _REGISTRY[name] = with_hooks(cls)
    return cls


def load_launchers() -> None:
    """Import the built-in launchers and every entry point of :data:`ENTRY_POINT_GROUP` (once)."""
    global _LOADED
    if _LOADED:
        return
    for module in _BUILTINS.values():
        importlib.import_module(module)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as exc:
            raise ImportError(
                f"entry point {ep.name!r} = {ep.value!r} in group {ENTRY_POINT_GROUP!r} "
                f"failed to load: {exc}"
            ) from exc
        if isinstance(obj, type):
            register_launcher(obj)
    _LOADED = True


def registered_launchers() -> dict[str, type]:
    """Every registered launcher class by name (built-ins and entry points loaded)."""
    load_launchers()
    return dict(sorted(_REGISTRY.items()))


def get_launcher(name: str) -> Any:
    """A new instance of the launcher registered as ``name``; ConfigError lists the known ones."""
    if name in _BUILTINS and name not in _REGISTRY:
        importlib.import_module(_BUILTINS[name])
    if name not in _REGISTRY:
        load_launchers()
    if name not in _REGISTRY:
        raise config_error(
            "launcher.name", name, f"choose one of {sorted(_REGISTRY)} (launcher=NAME)"
        )
    return _REGISTRY[name]()
