"""The run's config: the engine, launcher and task schemas, and the one way to check a field.

What task and launcher authors import: :class:`TaskConfig` (subclass it for a task's
typed fields), :class:`EngineConfig`, :class:`ConfigError` and the field checks of
:mod:`.fields`. :mod:`.run` holds the whole-run schema Hydra composes and its validation.
"""

from __future__ import annotations

from .engine import BACKENDS, NCCL_BACKENDS, EngineConfig, normalize_backend
from .fields import (
    ConfigError,
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_single_line,
    config_error,
    is_int,
    is_number,
    positive_int,
)
from .task import TaskConfig

__all__ = [
    "BACKENDS",
    "NCCL_BACKENDS",
    "ConfigError",
    "EngineConfig",
    "TaskConfig",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
    "check_single_line",
    "config_error",
    "is_int",
    "is_number",
    "normalize_backend",
    "positive_int",
]
