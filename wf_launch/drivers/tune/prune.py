"""Pruning without starting anything: validation alone, then the task's memory estimate.

The tuner composes the run's config the way ``python -m wf_launch`` does (Hydra's
compose API, the same YAML and schemas), once per combination of ``--also``
values, sets each layout's sizes and validates it with the launcher's own
:func:`~wf_launch.app.validate_run_config`: the engine's checks, the launcher's
and the task's ``validate(engine)``. A layout that passes is then checked against
``--mem-gb`` when the task config defines ``estimate_memory_gb(layout)``.
"""

from __future__ import annotations

import copy
import difflib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from worldfoundry.core.distributed.backends import local_gpu_count
from worldfoundry.core.validation import is_int

from ...app import validate_run_config
from ...cli import register_configs
from ...config.fields import ConfigError
from ...config.overrides import task_modules
from ...rank.task_registry import load_task_modules, task_config_class
from .space import Point, TuneError, override_key

__all__ = [
    "Verdict",
    "check_also_fields",
    "check_conflicts",
    "check_steps_field",
    "compose",
    "device_of",
    "explain_empty",
    "full_length",
    "memory_estimator",
    "prune",
    "task_config",
]

VALID, INVALID, MEMORY = "valid", "invalid", "memory"


@dataclass
class Verdict:
    """What pruning said of a point: ``valid``, ``invalid`` (validation refused it) or ``memory``
    (over --mem-gb)."""

    point: Point
    status: str
    message: str = ""
    estimate_gb: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "message": self.message, "estimate_gb": self.estimate_gb}


def _resolvers() -> None:
    OmegaConf.register_new_resolver("wf_uid", lambda: "tune", replace=True)
    OmegaConf.register_new_resolver("wf_config_groups", str, replace=True)


def compose(overrides_list: Iterable[list[str]]) -> list[dict[str, Any]]:
    """Each override list composed and resolved as ``python -m wf_launch OVERRIDES`` would (a plain
    dict).

    :class:`TuneError` when Hydra refuses the overrides (an unknown group option, a wrong type).
    """
    lists = [list(o) for o in overrides_list]
    try:
        load_task_modules(sorted({m for o in lists for m in task_modules(o)}))
    except ImportError as exc:
        raise TuneError(str(exc)) from None
    register_configs()
    _resolvers()
    GlobalHydra.instance().clear()
    out = []
    try:
        with initialize_config_module(config_module="wf_launch.conf", version_base="1.3"):
            for overrides in lists:
                cfg = hydra_compose(config_name="config", overrides=overrides)
                out.append(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        raise TuneError(f"the overrides do not compose: {exc}") from None
    finally:
        GlobalHydra.instance().clear()
    return out  # type: ignore[return-value]


def task_config(config: dict[str, Any]) -> Any:
    """The task's typed config (its dataclass) built from a composed config; :class:`TuneError` if
    refused."""

    task = config.get("task") or {}
    try:
        return task_config_class(str(task.get("name"))).build(task)
    except (KeyError, ConfigError) as exc:
        raise TuneError(str(exc.args[0] if isinstance(exc, KeyError) else exc)) from None


def check_steps_field(config: dict[str, Any], steps_field: str) -> None:
    """:class:`TuneError` unless the task has an integer ``steps_field``: the tuner sets each
    trial's length there."""

    task = config.get("task") or {}
    if not is_int(task.get(steps_field)):
        raise TuneError(
            f"task={task.get('name')} has no integer field {steps_field!r}: the tuner sets each "
            f"trial's length (a few steps, then more) through task.{steps_field}; name the task's "
            "steps field with --steps-field"
        )


def full_length(config: dict[str, Any], steps_field: str) -> int:
    """The steps of a full run: the task's ``steps_field`` as the command line leaves it."""
    return int((config.get("task") or {})[steps_field])


def device_of(config: dict[str, Any]) -> str:
    """'cuda' when the ranks will hold their state on GPUs (an NCCL backend, or auto with GPUs),
    else 'cpu'."""
    backend = str((config.get("engine") or {}).get("distributed_backend", "auto")).lower()
    if "nccl" in backend:
        return "cuda"
    if backend != "auto":
        return "cpu"
    if int((config.get("launcher") or {}).get("gpus_per_node") or 0) > 0:
        return "cuda"
    return "cuda" if local_gpu_count() else "cpu"


def memory_estimator(config: dict[str, Any]) -> Callable[[dict[str, Any]], float] | None:
    """The task config's ``estimate_memory_gb`` (bound), or None when its task defines none."""
    fn = getattr(task_config(config), "estimate_memory_gb", None)
    return fn if callable(fn) else None


def _with_layout(config: dict[str, Any], point: Point) -> dict[str, Any]:
    out = copy.deepcopy(config)
    for dim, size in point.sizes:
        out["engine"][f"{dim}_size"] = size
    return out


def _estimate(estimator: Callable[[dict[str, Any]], float], point: Point, device: str) -> float:
    try:
        value = float(estimator({**point.layout, "device": device}))
    except Exception as exc:
        raise TuneError(
            f"the task's estimate_memory_gb failed for {point.label}: {type(exc).__name__}: {exc}"
        ) from None
    if not math.isfinite(value) or value < 0:
        raise TuneError(
            f"the task's estimate_memory_gb returned {value!r} for {point.label}: expected GB >= 0"
        )
    return value


def prune(
    points: list[Point],
    configs: dict[tuple[tuple[str, str], ...], dict[str, Any]],
    mem_gb: float | None,
) -> list[Verdict]:
    """A verdict for every point; ``configs`` maps each ``--also`` combination to its composed
    config."""

    verdicts = []
    estimators: dict[tuple[tuple[str, str], ...], Any] = {}
    for point in points:
        config = _with_layout(configs[point.also], point)
        try:
            validate_run_config(config)
        except (ConfigError, ValueError) as exc:
            verdicts.append(Verdict(point, INVALID, str(exc)))
            continue
        if point.also not in estimators:
            estimators[point.also] = (memory_estimator(config), device_of(config))
        estimator, device = estimators[point.also]
        estimate = _estimate(estimator, point, device) if estimator is not None else None
        if mem_gb is not None and estimate is not None and estimate > mem_gb:
            verdicts.append(
                Verdict(
                    point,
                    MEMORY,
                    f"estimated {estimate:.3g} GB per rank > --mem-gb {mem_gb:g}",
                    estimate,
                )
            )
        else:
            verdicts.append(Verdict(point, VALID, "", estimate))
    return verdicts


def explain_empty(verdicts: list[Verdict], world_size: int, mem_gb: float | None) -> str:
    """Why no point survived: every layout refused (the reasons, grouped), or --mem-gb below every
    estimate."""
    memory = [v for v in verdicts if v.status == MEMORY]
    if memory:
        low = min(memory, key=lambda v: v.estimate_gb or 0.0)
        return (
            f"--mem-gb {mem_gb:g} prunes every valid layout ({len(memory)}): the smallest estimate "
            "is "
            f"{low.estimate_gb:.3g} GB per rank ({low.point.label}); raise --mem-gb to at least "
            "that"
        )
    reasons: dict[str, list[str]] = {}
    for v in verdicts:
        reasons.setdefault(v.message, []).append(v.point.label)
    lines = [
        f"world_size={world_size}: no layout fits: all {len(verdicts)} point(s) were refused by "
        "validation:"
    ]
    for message, labels in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(labels[:4]) + (f" and {len(labels) - 4} more" if len(labels) > 4 else "")
        lines.append(f"  {shown}: {message}")
    return "\n".join(lines)


def check_conflicts(overrides: list[str], axes: list[tuple[str, list[str]]]) -> None:
    """:class:`TuneError` when a key is both a fixed override and an ``--also`` axis."""
    fixed = {override_key(o): o for o in overrides}
    for key, _ in axes:
        if key in fixed:
            raise TuneError(
                f"{fixed[key]!r} and --also {key}=...: give the values to search in --also only"
            )


def _missing_part(config: dict[str, Any], key: str) -> tuple[str, list[str]] | None:
    """(the first part of the dotted ``key`` that ``config`` lacks, the fields beside it), or None
    when ``config`` has the key."""
    node: Any = config
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            fields = sorted(node) if isinstance(node, dict) else []
            return ".".join(parts[: i + 1]), fields
        node = node[part]
    return None


def check_also_fields(config: dict[str, Any], axes: list[tuple[str, list[str]]]) -> None:
    """:class:`TuneError` when an ``--also`` key is not a field of the composed config: the message
    names the fields there are (the task's, for ``task.*``), closest first."""
    for key, values in axes:
        missing = _missing_part(config, key)
        if missing is None:
            continue
        name, fields = missing
        parent = name.rpartition(".")[0]
        owner = f"task={config['task'].get('name')}" if parent == "task" else parent or "the config"
        close = difflib.get_close_matches(name.rpartition(".")[2], fields, n=3)
        raise TuneError(
            f"--also {key}={','.join(values)}: {owner} has no field {name.rpartition('.')[2]!r} "
            f"(its fields: {', '.join(fields)})"
            + (f"; did you mean {' or '.join(close)}?" if close else "")
        )
