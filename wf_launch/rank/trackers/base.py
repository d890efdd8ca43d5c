"""What every experiment tracker implements, and what it is given.

A :class:`Tracker` writes one rank's metrics to one library (TensorBoard, MLflow, W&B). It is
driven by :class:`~wf_launch.rank.trackers.hub.TrackerHub` from a thread of its own, never from
the training loop, and never sees the same step twice: the hub drops the steps the tracker
already holds (:meth:`Tracker.open` says which) so that a resumed attempt continues its curves
instead of repeating or rewinding them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from worldfoundry.core.validation import is_int

__all__ = ["STATUSES", "Tracker", "TrackerSettings", "flat_params"]

STATUSES = ("ok", "interrupted", "failed")
"""How an attempt ended, as the rank closes its trackers: completed, stopped to be resumed,
failed."""


@dataclass
class TrackerSettings:
    """Everything a tracker is given: where the run is, who it is, its section of ``tracking``, its
    state.

    ``tagged`` (``tracking.all_ranks``): every rank tracks, so names carry the rank. ``state`` is
    the tracker's record from earlier attempts (``tracking/NAME.json``: ``last_step``, ``run``).
    """

    run_dir: Path
    run_id: str
    rank: int
    attempt: int
    tagged: bool
    config: dict[str, Any]
    section: dict[str, Any]
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def run_name(self) -> str:
        """How the run is named to a person: the run directory's name (``rankR`` added when every
        rank tracks)."""
        name = Path(self.run_dir).name
        return f"{name}-rank{self.rank}" if self.tagged and self.rank else name

    @property
    def last_step(self) -> int | None:
        """The last step this tracker recorded as written in an earlier attempt (None: none)."""
        step = self.state.get("last_step")
        return step if is_int(step) else None


class Tracker:
    """One tracker on one rank. Subclasses set :attr:`name` and override the four methods."""

    name: ClassVar[str] = ""

    def __init__(self, settings: TrackerSettings) -> None:
        self.settings = settings

    def open(self) -> int | None:
        """Start or resume the tracked run (the config as hyper-parameters); the last step it
        already holds."""
        raise NotImplementedError

    def log(self, points: list[tuple[int, dict[str, float]]]) -> None:
        """Write ``(step, {metric: value})`` points, steps increasing."""
        raise NotImplementedError

    def flush(self) -> None:
        """Make what was logged durable (the hub records the last step after this returns)."""

    def close(self, status: str) -> None:
        """Record how this attempt ended (one of :data:`STATUSES`) and release the library's
        resources."""

    def run_ref(self) -> str | None:
        """The tracked run's own id, kept in the tracker's state (None when it has none of its
        own)."""
        return None


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """The resolved config as ``{"engine.cp_size": 2, ...}``: numbers, bools and strings kept, the
    rest as text."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_params(value, f"{name}."))
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[name] = "null" if value is None else value
        else:
            out[name] = str(value)
    return out
