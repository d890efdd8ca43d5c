"""A tune's record, ``DIR/tune.json``: what was asked, the space and its pruning, each round, each
measurement.

It is rewritten atomically after every trial, so an interrupted tune (Ctrl-C, SIGTERM,
a killed process) leaves everything it had measured; ``--resume DIR`` reads it back and
continues. ``args`` is the tune's identity: a ``--resume`` whose arguments differ from
them is refused, naming what differs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...rundir import files
from ...rundir.io import atomic_write_json, read_json
from .measure import Measurement, higher_is_better
from .record_check import check_record
from .space import TuneError

__all__ = ["FORMAT", "IDENTITY", "TuneState", "order_points"]

FORMAT = 1
IDENTITY = (
    "world_size",
    "overrides",
    "also",
    "mem_gb",
    "metric",
    "warmup",
    "min_steps",
    "cutoff",
    "steps_field",
)
"""The arguments that make a tune what it is; ``--budget-s`` and ``--stall-s`` may change on a
resume."""
DONE, RUNNING, INTERRUPTED, BUDGET, FAILED = "done", "running", "interrupted", "budget", "failed"


@dataclass
class TuneState:
    """Everything a tune knows; :meth:`save` writes it to ``DIR/tune.json``."""

    dir: Path
    args: dict[str, Any]
    command: list[str] = field(default_factory=list)
    full_length: int = 0
    launcher: str = "local"
    space: list[dict[str, Any]] = field(default_factory=list)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    measurements: list[dict[str, Any]] = field(default_factory=list)
    status: str = RUNNING
    winner: str | None = None
    elapsed_s: float = 0.0
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    sessions: int = 1
    _t0: float = field(default_factory=time.monotonic, repr=False)
    _base: float = field(default=0.0, repr=False)

    # ------------------------------------------------------------------ time
    def elapsed(self) -> float:
        """Seconds this tune has run, over every session (the resumed ones too)."""
        return self._base + time.monotonic() - self._t0

    # ------------------------------------------------------------------ files
    @property
    def path(self) -> Path:
        return self.dir / files.TUNE_STATE

    def save(self) -> None:
        self.elapsed_s = round(self.elapsed(), 3)
        data = {k: v for k, v in asdict(self).items() if not k.startswith("_") and k != "dir"}
        atomic_write_json(self.path, {"format": FORMAT, "dir": str(self.dir), **data})

    @classmethod
    def load(cls, directory: Path) -> TuneState:
        """The tune in ``directory``; :class:`TuneError` when it holds none, or one this version
        cannot read, or a field that is not allowed (:func:`.record_check.check_record`)."""
        path = Path(directory) / files.TUNE_STATE
        try:
            data = read_json(path)
        except (OSError, ValueError) as exc:
            raise TuneError(f"--resume {directory}: {path} is not readable ({exc})") from None
        if data is None:
            raise TuneError(
                f"--resume {directory}: not a tune directory (no {files.TUNE_STATE}; a tune "
                "writes it "
                "when it starts)"
            )
        if (
            not isinstance(data, dict)
            or data.get("format") != FORMAT
            or not isinstance(data.get("args"), dict)
        ):
            raise TuneError(
                f"--resume {directory}: {path} is not a tune record this version can read "
                f"(format {data.get('format') if isinstance(data, dict) else '?'})"
            )
        check_record(data, f"--resume {path}")
        known = {
            k: v for k, v in data.items() if k in cls.__dataclass_fields__ and not k.startswith("_")
        }
        state = cls(**{**known, "dir": Path(directory)})
        state._base = float(data.get("elapsed_s") or 0.0)
        state.sessions = int(data.get("sessions") or 1) + 1
        return state

    # ------------------------------------------------------------------ identity
    def differences(self, args: dict[str, Any]) -> list[str]:
        """What differs between this tune's identity and ``args`` (empty: the same tune)."""
        return [
            f"{key}: {self.args.get(key)!r} in {self.dir}, {args.get(key)!r} now"
            for key in IDENTITY
            if self.args.get(key) != args.get(key)
        ]

    # ------------------------------------------------------------------ measurements
    def add(self, m: Measurement) -> None:
        """Record ``m`` (replacing an earlier measurement of the same trial and round)."""
        self.measurements = [
            d for d in self.measurements if (d["trial"], d["round"]) != (m.trial, m.round)
        ]
        self.measurements.append(m.to_json())

    def of_round(self, round_index: int) -> list[Measurement]:
        return [Measurement.from_json(d) for d in self.measurements if d["round"] == round_index]

    def latest(self, trial: str) -> Measurement | None:
        """The trial's measurement of its latest round that measured it."""
        mine = [d for d in self.measurements if d["trial"] == trial and d["status"] == "ok"]
        return Measurement.from_json(max(mine, key=lambda d: d["round"])) if mine else None

    def point(self, trial: str) -> dict[str, Any]:
        return next(p for p in self.space if p["id"] == trial)


def order_points(state: TuneState) -> list[dict[str, Any]]:
    """Points best first: the winner, then by the last round reached and the value there; pruned
    last."""
    higher = higher_is_better(state.args["metric"])

    def key(point: dict[str, Any]) -> tuple[Any, ...]:
        if point["verdict"]["status"] != "valid":
            return (2, 0, 0.0, point["id"])
        m = state.latest(point["id"])
        reached = max((r["index"] for r in state.rounds if point["id"] in r["trials"]), default=-1)
        value = (m.value if higher else -m.value) if m is not None else float("-inf")
        return (0 if point["id"] == state.winner else 1, -reached, -value, point["id"])

    return sorted(state.space, key=key)
