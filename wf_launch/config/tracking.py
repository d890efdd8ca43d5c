"""The ``tracking`` section: which experiment trackers follow the run (``tracking=tensorboard``,
a list for several).

Each tracker has a sub-section, off until its option is selected
(``wf_launch/conf/tracking/NAME.yaml`` sets its ``enabled``): ``tracking=[tensorboard,mlflow]``
turns both on, ``tracking=none`` (the default) none; a tracker's fields can be set whether or
not it is on. The libraries are optional extras; a tracker whose library is missing is refused
before anything starts, with the command that installs it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .fields import (
    check_choice,
    check_fields,
    check_single_line,
    config_error,
    flag,
    number,
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

    enabled: bool = flag(False)
    log_dir: str | None = None


@dataclass
class MLflowConfig:
    """One MLflow run per wf_launch run, continued by every attempt."""

    enabled: bool = flag(False)
    uri: str | None = None
    experiment: str = "wf_launch"
    run_name: str | None = None

    def check_selected(self) -> None:
        """What a selected MLflow tracker needs: non-empty single-line names, null where allowed."""
        for key in ("uri", "experiment", "run_name"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise config_error(
                    f"tracking.mlflow.{key}",
                    value,
                    "a non-empty string" + ("" if key == "experiment" else " or null"),
                )
            check_single_line(f"tracking.mlflow.{key}", value)


@dataclass
class WandbConfig:
    """One W&B run per wf_launch run: its id is the run id, resumed by every attempt."""

    enabled: bool = flag(False)
    project: str = "wf_launch"
    entity: str | None = None
    mode: str | None = None
    name: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)

    def check_selected(self) -> None:
        """What a selected W&B tracker needs: a known mode, single-line names, a project."""
        check_choice(
            "tracking.wandb.mode",
            self.mode,
            WANDB_MODES,
            note="(null: W&B's own default, WANDB_MODE)",
        )
        for key in ("project", "entity", "name", "group"):
            check_single_line(f"tracking.wandb.{key}", getattr(self, key))
        if not isinstance(self.project, str) or not self.project.strip():
            raise config_error("tracking.wandb.project", self.project, "a non-empty string")


@dataclass
class TrackingConfig:
    """Which trackers follow the run's ``ctx.progress`` metrics, config and final status."""

    all_ranks: bool = flag(False)
    flush_s: float = number(1.0, 0, 3600, low_open=True, unit="seconds")
    close_timeout_s: float = number(
        30.0,
        0,
        3600,
        unit="seconds",
        note="(how long a rank waits at its end for the trackers to write what they hold)",
    )
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> TrackingConfig:
        """The ``tracking`` section as a checked dataclass (a run config without one tracks
        nothing).
        """
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
        """Raise :class:`ConfigError` for a bad value, or a selected tracker whose library is
        not installed.
        """
        check_fields(self, "tracking")
        for name in TRACKERS:
            check_fields(getattr(self, name), f"tracking.{name}")
        if self.mlflow.enabled:
            self.mlflow.check_selected()
        if self.wandb.enabled:
            self.wandb.check_selected()
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
