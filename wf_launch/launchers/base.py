"""The launcher protocol: what every way of starting ranks provides.

A launcher is a class with a ``name``, a config dataclass (the Hydra schema of
``launcher=NAME``), and ``validate`` / ``describe`` / ``launch``. Launchers whose
runs outlive the command (``launcher.wait=false`` on a scheduler) also provide
``status`` and ``cancel``, which ``python -m wf_launch.status`` uses. Built-in
launchers and third-party ones (entry-point group ``wf_launch.launchers``)
register the same way (:func:`wf_launch.launchers.register_launcher`);
docs/launchers.md shows a new one end to end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from omegaconf import MISSING

from ..config import config_error

if TYPE_CHECKING:
    from worldfoundry.core.distributed.topology import Layout

    from ..outcome import RunOutcome
    from ..plan import LaunchPlan

__all__ = ["DetachedLauncher", "Launcher", "LauncherConfig", "validate_common"]


@dataclass
class LauncherConfig:
    """What every launcher's config has (subclass it for a launcher's own fields)."""

    name: str = MISSING
    dry_run: bool = False
    console_ranks: list[int] | None = None
    max_log_mb: float = 1024.0
    overwrite: bool = False
    resume: bool = False
    run_dir_mode: str = "0700"
    progress_interval_s: float = 10.0
    stall_warning_s: float = 300.0


@runtime_checkable
class Launcher(Protocol):
    """How rank processes come to exist. One instance serves one CLI invocation."""

    name: ClassVar[str]
    config_class: ClassVar[type[LauncherConfig]]

    def validate(self, cfg: dict[str, Any], layout: Layout, engine: dict[str, Any]) -> None:
        """Raise :class:`~wf_launch.config.ConfigError` (field, value, what is allowed) before any process starts."""

    def describe(self, plan: LaunchPlan) -> str:
        """The launch plan as text, for ``launcher.dry_run=true`` (starts nothing)."""

    def launch(self, plan: LaunchPlan) -> RunOutcome:
        """Start every rank of ``plan``, and (unless detached) wait and finalize the run record."""


@runtime_checkable
class DetachedLauncher(Launcher, Protocol):
    """A launcher whose runs can outlive the command that started them."""

    def status(self, run_dir: Path) -> tuple[str, RunOutcome | None]:
        """The scheduler's state of the run, and its final outcome once it ended (finalizing the record)."""

    def cancel(self, run_dir: Path) -> str | None:
        """Stop the run if it still runs; returns the scheduler's id of what was cancelled (None: nothing)."""


def validate_common(cfg: dict[str, Any], world_size: int) -> None:
    """The fields every launcher has."""
    ranks = cfg.get("console_ranks")
    if ranks is not None:
        bad = [r for r in ranks if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < world_size]
        if bad:
            raise config_error("launcher.console_ranks", list(ranks),
                               f"ranks must be integers in [0, {world_size - 1}] (null shows every rank)")
    max_log = cfg.get("max_log_mb", 0)
    if isinstance(max_log, bool) or not isinstance(max_log, (int, float)) or not 0 <= max_log < float("inf"):
        raise config_error("launcher.max_log_mb", max_log, "expected MB >= 0 per rank log (0 = no cap)")
    mode = cfg.get("run_dir_mode", "0700")
    if not isinstance(mode, str) or not re.fullmatch(r"0?[0-7]{3}", mode) or int(mode, 8) & 0o700 != 0o700:
        raise config_error("launcher.run_dir_mode", mode, "an octal mode string such as '0700' or '0750' "
                           "that leaves the owner rwx")
    for key in ("progress_interval_s", "stall_warning_s"):
        value = cfg.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.1 <= value <= 7 * 24 * 3600:
            raise config_error(f"launcher.{key}", value, "expected seconds from 0.1 to a week")
    for key in ("dry_run", "overwrite", "resume"):
        if not isinstance(cfg.get(key, False), bool):
            raise config_error(f"launcher.{key}", cfg.get(key), "expected true or false")
    if cfg.get("overwrite") and cfg.get("resume"):
        raise config_error("launcher.resume", True, "not together with launcher.overwrite=true (resume continues "
                           "the run in the directory; overwrite moves it aside): choose one")
