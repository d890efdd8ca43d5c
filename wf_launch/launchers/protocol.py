"""The launcher protocol: what every way of starting ranks provides.

A launcher is a class with a ``name``, a config dataclass (the Hydra schema of
``launcher=NAME``, a :class:`~.base.LauncherConfig`), and ``validate`` / ``describe`` /
``launch`` (:class:`Launcher`). Launchers whose runs outlive the command
(``launcher.wait=false`` on a scheduler) also provide ``status`` and ``cancel``
(:class:`DetachedLauncher`), which ``python -m wf_launch.status`` uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from .base import LauncherConfig

if TYPE_CHECKING:
    from worldfoundry.core.distributed.topology import Layout

    from ..config.engine import EngineConfig
    from ..rundir.outcome import RunOutcome
    from .launch_plan import LaunchPlan

__all__ = ["DetachedLauncher", "Launcher"]


@runtime_checkable
class Launcher(Protocol):
    """How rank processes come to exist. One instance serves one CLI invocation."""

    name: ClassVar[str]
    config_class: ClassVar[type[LauncherConfig]]

    def validate(self, cfg: Any, layout: Layout, engine: EngineConfig) -> None:
        """Raise :class:`~wf_launch.config.ConfigError` (field, value, what is allowed) before any
        process starts.

        ``cfg`` is an instance of ``config_class`` whose common fields are already checked.
        """

    def describe(self, plan: LaunchPlan) -> str:
        """The plan as text for ``launcher.dry_run=true`` (starts nothing, writes nothing)."""

    def launch(self, plan: LaunchPlan) -> RunOutcome:
        """Start every rank of ``plan``, and (unless detached) wait and finalize the run record."""


@runtime_checkable
class DetachedLauncher(Launcher, Protocol):
    """A launcher whose runs can outlive the command that started them."""

    def status(self, run_dir: Path) -> tuple[str, RunOutcome | None]:
        """The scheduler's state of the run, and its final outcome once it ended (finalizing the
        record).
        """

    def cancel(self, run_dir: Path) -> str | None:
        """Stop the run if it still runs; returns the scheduler's id of what was cancelled (None:
        nothing).
        """
