"""The ``tracking`` section: which experiment trackers follow the run (``tracking=tensorboard``, a list for several).

Each tracker has a sub-section, off until its option is selected (``wf_launch/conf/tracking/NAME.yaml``
sets its ``enabled``): ``tracking=[tensorboard,mlflow]`` turns both on, ``tracking=none`` (the
default) none; a tracker's fields can be set whether or not it is on. The libraries are optional extras; a tracker
whose library is missing is refused before anything starts, with the command that installs it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .fields import (
    check_bool,
    check_choice,
    check_number,
    check_single_line,
    config_error,
    unknown_field,
)

__all__ = [
    "TRACKERS",
    "MLflowConfig",
    "TensorBoardConfig",
    "TrackingConfig",
    "WandbConfig",
    "enabled_trackers",
]

PACKAGE = "worldfoundry-launch"
TRACKERS: dict[str, str] = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
"""Tracker name -> the module its library provides (the pip extra has the tracker's name)."""
WANDB_MODES = (None, "online", "offline", "disabled")


@dataclass
class TensorBoardConfig:
    """TensorBoard event files (``torch.utils.tensorboard``)."""

    enabled: bool = False
    log_dir: str | None = None


@dataclass
class MLflowConfig:
    """One MLflow run per wf_launch run, continued by every attempt."""

    enabled: bool = False
    uri: str | None = None
    experiment: str = "wf_launch"
    run_name: str | None = None


@dataclass
class WandbConfig:
    """One W&B run per wf_launch run: its id is the run id, resumed by every attempt."""

    enabled: bool = False
    project: str = "wf_launch"
    entity: str | None = None
    mode: str | None = None
    name: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class TrackingConfig:
    """Which trackers follow the run's ``ctx.progress`` metrics, config and final status."""

    all_ranks: bool = False
    flush_s: float = 1.0
    close_timeout_s: float = 30.0
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> TrackingConfig:
        """The ``tracking`` section as a checked dataclass (a run config without one tracks nothing)."""
        section = dict(section or {})
        _check_keys("tracking", section, cls)
        sub = {
            name: kind
            for name, kind in (
                ("tensorboard", TensorBoardConfig),
                ("mlflow", MLflowConfig),
                ("wandb", WandbConfig),
            )
        }
        values: dict[str, Any] = {}
        for key, value in section.items():
            if key in sub:
                if not isinstance(value, Mapping):
                    raise config_error(f"tracking.{key}", value, f"a mapping of {key}'s fields")
                _check_keys(f"tracking.{key}", value, sub[key])
                values[key] = sub[key](
                    **{k: (list(v) if k == "tags" else v) for k, v in value.items()}
                )
            else:
                values[key] = value
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise :class:`ConfigError` for a bad value, or a selected tracker whose library is not installed."""
        check_bool("tracking.all_ranks", self.all_ranks)
        for name in TRACKERS:
            check_bool(f"tracking.{name}.enabled", getattr(self, name).enabled)
        check_number("tracking.flush_s", self.flush_s, 0, 3600, low_open=True, unit="seconds")
        check_number(
            "tracking.close_timeout_s",
            self.close_timeout_s,
            0,
            3600,
            unit="seconds",
            note="(how long a rank waits at its end for the trackers to write what they hold)",
        )
        if self.mlflow.enabled:
            for key in ("uri", "experiment", "run_name"):
                value = getattr(self.mlflow, key)
                if value is not None and (not isinstance(value, str) or not value.strip()):
                    raise config_error(
                        f"tracking.mlflow.{key}",
                        value,
                        "a non-empty string" + ("" if key == "experiment" else " or null"),
                    )
                check_single_line(f"tracking.mlflow.{key}", value)
        if self.wandb.enabled:
            check_choice(
                "tracking.wandb.mode",
                self.wandb.mode,
                WANDB_MODES,
                note="(null: W&B's own default, WANDB_MODE)",
            )
            for key in ("project", "entity", "name", "group"):
                check_single_line(f"tracking.wandb.{key}", getattr(self.wandb, key))
            if not isinstance(self.wandb.project, str) or not self.wandb.project.strip():
                raise config_error(
                    "tracking.wandb.project", self.wandb.project, "a non-empty string"
                )
        for name in enabled_trackers(self):
            if not _installed(TRACKERS[name]):
                raise config_error(
                    "tracking",
                    name,
                    f"the {TRACKERS[name]} library is not installed in this "
                    f"environment; install it with: pip install '{PACKAGE}[{name}]'",
                )


def enabled_trackers(cfg: TrackingConfig | Mapping[str, Any] | None) -> list[str]:
    """The selected trackers' names, in a fixed order (a plain ``tracking`` section works too)."""
    if cfg is None:
        return []
    if isinstance(cfg, Mapping):
        return [
            name
            for name in TRACKERS
            if isinstance(cfg.get(name), Mapping) and cfg[name].get("enabled") is True
        ]
    return [name for name in TRACKERS if getattr(cfg, name).enabled]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _check_keys(where: str, section: Mapping[str, Any], kind: type) -> None:
    known = [f.name for f in fields(kind)]
    for key in section:
        if key not in known:
            raise unknown_field(f"{where}.{key}", section[key], known)
