"""The command line's overrides as config errors: internal schemas refused, Hydra's own errors
named.

Hydra refuses a typo (``engine.cp_sise=2``), an unknown option (``task=nonexistent``) or a value
of the wrong type (``engine.pp_size=two``) with its own text and exit code 1, and suggests
``+engine.cp_sise=2``, which only leads to a second refusal. :func:`hydra_config_error` turns
those exceptions into one :class:`ConfigError` that names the override, what is allowed and the
field that was probably meant, so that the CLI exits 2 like every other config mistake.
:func:`refuse_schemas` keeps the structured schemas the YAML builds on (``*_schema``) from being
picked as an option.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

from .fields import ConfigError, closest

__all__ = [
    "SCHEMA_SUFFIX",
    "group_options",
    "hydra_config_error",
    "refuse_schemas",
    "task_modules",
]

SCHEMA_SUFFIX = "_schema"
"""The structured configs registered for the YAML to build on (``engine_schema``, ``local_schema``,
...)."""


def task_modules(overrides: Iterable[str]) -> list[str]:
    """The modules named by ``task.modules=[a,b]`` / ``+task.modules=a`` among ``overrides``.

    They are imported (their tasks register, each with a ``task=NAME`` config) before Hydra
    composes, so the command line is read for them first.
    """
    mods: list[str] = []
    for arg in overrides:
        key, sep, value = arg.lstrip("+~").partition("=")
        if sep and key == "task.modules":
            value = value.strip().strip("[]")
            mods += [m.strip().strip("'\"") for m in value.split(",") if m.strip()]
    return mods


def _split(arg: str) -> tuple[str, str] | None:
    key, sep, value = arg.lstrip("+~").partition("=")
    return (key, value) if sep else None


def group_options(group: str) -> list[str]:
    """The options of config group ``group`` a user can pick: its YAML files and stored configs,
    without schemas."""
    from importlib.resources import files

    from hydra.core.config_store import ConfigStore

    names: set[str] = set()
    try:
        folder = files("wf_launch.conf").joinpath(*group.split("/"))
        names |= {
            p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
        }
    except (FileNotFoundError, NotADirectoryError, ModuleNotFoundError):
        pass
    try:
        names |= {n.removesuffix(".yaml") for n in ConfigStore.instance().list(group)}
    except OSError:
        pass
    return sorted(n for n in names if not n.endswith(SCHEMA_SUFFIX))


def refuse_schemas(argv: Iterable[str]) -> None:
    """:class:`ConfigError` for a group option that is an internal schema (``task=task_schema``)."""
    for arg in argv:
        split = _split(arg)
        if split is None or "." in split[0] or split[0].startswith("hydra"):
            continue
        group, value = split
        for choice in (c.strip() for c in value.strip("[]").split(",")):
            if choice.endswith(SCHEMA_SUFFIX):
                raise ConfigError(
                    f"{group}={choice} is not allowed: {choice} is an internal schema, not an "
                    "option; "
                    f"choose one of {group_options(group)}"
                )


def _override(argv: Iterable[str], key: str) -> str | None:
    """The command line's override of ``key`` or of a field under it, as typed."""
    for arg in argv:
        split = _split(arg)
        if split is not None and (split[0] == key or split[0].startswith(key + ".")):
            return arg.lstrip("+~")
    return None


def _field_names(kind: Any) -> list[str]:
    return (
        sorted(f.name for f in dataclasses.fields(kind)) if dataclasses.is_dataclass(kind) else []
    )


_CONVERSIONS = {
    "Integer": "expected an integer",
    "Float": "expected a number",
    "Boolean": "expected true or false",
}


def _wrong_type(cause: BaseException) -> str:
    """OmegaConf's "Value 'two' of type 'str' could not be converted to Integer" as what is
    allowed."""
    text = _first_line(cause)
    target = text.rpartition(" converted to ")[2].strip()
    return _CONVERSIONS.get(target, text)


def _unknown_key(cause: Any, argv: list[str]) -> ConfigError:
    full_key = str(getattr(cause, "full_key", "") or "")
    parent, _, leaf = full_key.rpartition(".")
    override = _override(argv, full_key) or full_key
    known = _field_names(getattr(cause, "object_type", None))
    owner = parent or "the config"
    text = f"{override} is not allowed: {owner} has no field {leaf!r}"
    guess = closest(leaf, known)
    if guess:
        meant = (f"{parent}.{guess}" if parent else guess) + override[len(full_key) :]
        text += f"; did you mean {meant}?"
    return ConfigError(text + (f" ({owner}'s fields: {known})" if known else ""))


def _missing_option(exc: Any) -> ConfigError:
    group, _, option = str(exc.missing_cfg_file).rpartition("/")
    options = group_options(group)
    guess = closest(option, options)
    text = f"{group}={option} is not allowed: choose one of {options}" + (
        f"; did you mean {group}={guess}?" if guess else ""
    )
    if group == "task":
        text += " (a task of your own module: task=NAME 'task.modules=[my_pkg.tasks]')"
    return ConfigError(text)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def hydra_config_error(exc: BaseException, argv: list[str]) -> ConfigError | None:
    """The config error ``exc`` (raised while Hydra composed the config) stands for; None when it is
    not one."""
    from hydra.errors import (
        ConfigCompositionException,
        MissingConfigException,
        OverrideParseException,
    )
    from omegaconf.errors import (
        ConfigAttributeError,
        ConfigKeyError,
        OmegaConfBaseException,
        ValidationError,
    )

    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, MissingConfigException) and getattr(exc, "missing_cfg_file", None):
        return _missing_option(exc)
    if isinstance(exc, OverrideParseException):
        return ConfigError(
            f"{_first_line(exc)} (the override syntax: "
            "https://hydra.cc/docs/advanced/override_grammar/basic/)"
        )
    cause = exc.__cause__ if isinstance(exc, ConfigCompositionException) else exc
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and getattr(
        cause, "full_key", None
    ):
        return _unknown_key(cause, argv)
    if isinstance(cause, ValidationError) and getattr(cause, "full_key", None):
        override = _override(argv, str(cause.full_key)) or str(cause.full_key)
        return ConfigError(f"{override} is not allowed: {_wrong_type(cause)}")
    if isinstance(cause, OmegaConfBaseException):
        where = getattr(cause, "full_key", None)
        return ConfigError(f"{where + ': ' if where else ''}{_first_line(cause)}")
    if isinstance(exc, ConfigCompositionException):
        return ConfigError(_ambiguous(exc) or _first_line(exc))
    return None


def _ambiguous(exc: BaseException) -> str | None:
    """Hydra's "Ambiguous value" (a comma outside ``--multirun``) in one line that says how to quote
    the value, since its own advice spans three lines and ``_first_line`` would drop it."""
    match = re.match(r"Ambiguous value for argument '([^=']+)=([^']*)'", str(exc))
    if match is None:
        return None
    key, value = match.groups()
    return (
        f"{key}={value} is ambiguous: a comma makes a list or a sweep; for the string, quote it "
        f"('{key}=\"{value}\"' in a shell), for a sweep add --multirun"
    )
