"""The run's config: the engine, launcher and task schemas, and the one way to check a field.

What task and launcher authors import: :class:`TaskConfig` (subclass it for a task's
typed fields), :class:`EngineConfig`, :class:`ConfigError`, the field checks of
:mod:`.fields` and the declared rules (``integer``, ``number``, ``flag``, ``choice``,
``line``) that :func:`check_fields` applies. :mod:`.run` holds the whole-run schema Hydra composes
and its validation.
"""

from __future__ import annotations

from .engine import BACKENDS, NCCL_BACKENDS, EngineConfig, normalize_backend
from .fields import (
    ConfigError,
    Rule,
    check_bool,
    check_choice,
    check_fields,
    check_int,
    check_number,
    check_single_line,
    choice,
    config_error,
    flag,
    integer,
    is_int,
    is_number,
    line,
    number,
    positive_int,
    redefault,
)
from .task import TaskConfig

__all__ = [
    "BACKENDS",
    "NCCL_BACKENDS",
    "ConfigError",
    "EngineConfig",
    "Rule",
    "TaskConfig",
    "check_bool",
    "check_choice",
    "check_fields",
    "check_int",
    "check_number",
    "check_single_line",
    "choice",
    "config_error",
    "flag",
    "integer",
    "is_int",
    "is_number",
    "line",
    "normalize_backend",
    "number",
    "positive_int",
    "redefault",
]
