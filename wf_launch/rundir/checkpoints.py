"""A checkpoint on disk: directory names, the ``COMMIT`` record, the layout that saved it, and which
ones load.

Nothing here needs a process group: the checkpointer, ``python -m wf_launch.checkpoint``
and the drill read checkpoints through this module.

A checkpoint is complete when its directory has ``COMMIT``. Normally that directory is
``step_XXXXXXXX``; while a step is saved a second time (or after a crash in the middle of
that), the complete copy may sit under a hidden name (``.step_XXXXXXXX.tmp-<hex>`` with
its ``COMMIT`` already written, or ``.step_XXXXXXXX.old-<hex>``, the copy being replaced).
:func:`complete_checkpoints` counts those too, so at every instant a complete checkpoint
is found. Order is **commit order** (``COMMIT``'s ``seq``), not step order.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worldfoundry.core.distributed.topology import DIMS, Layout

from . import files
from .io import read_bytes

__all__ = [
    "COMMIT_FILE",
    "FORMAT",
    "Candidate",
    "CheckpointUnreadable",
    "Commit",
    "candidates",
    "complete_checkpoints",
    "describe_layout",
    "layout_dict",
    "layout_of",
    "parse_step",
    "rank_file",
    "read_commit",
    "step_name",
    "write_commit",
]

COMMIT_FILE = "COMMIT"
FORMAT = 2
"""Format of checkpoints written now: global parameter names, flat optimizer state, scoped per-rank
entries,
the saving layout in ``COMMIT``. Format 1 (no ``format`` in ``COMMIT``) loads on the same world size
only."""
METADATA_FILE = ".metadata"
_PREFIX = "step_"
_HIDDEN_COMPLETE = (".tmp-", ".old-")


class CheckpointUnreadable(Exception):
    """A committed checkpoint whose files cannot be read (torn, truncated, missing): load falls
    back."""


def step_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a ``step_XXXXXXXX`` directory name (None: not one)."""
    if not name.startswith(_PREFIX):
        return None
    digits = name[len(_PREFIX) :]
    return int(digits) if digits.isdigit() else None


def hidden_step(name: str) -> tuple[int, str] | None:
    """``(step, kind)`` of a hidden ``.step_XXXXXXXX.KIND-<hex>`` name (kind: tmp, old, del), else
    None."""
    if not name.startswith(f".{_PREFIX}"):
        return None
    base, dot, rest = name[1:].partition(".")
    step = parse_step(base)
    kind = rest.partition("-")[0]
    if step is None or not dot or kind not in ("tmp", "old", "del"):
        return None
    return step, kind


def rank_file(directory: Path, rank: int) -> Path:
    """Rank ``rank``'s per-rank file in a checkpoint directory."""
    return directory / f"rank_{rank:05d}.pt"


def layout_dict(layout: Layout) -> dict[str, Any]:
    """A layout as ``COMMIT`` and the attempt records keep it: sizes, order, world size."""
    return {
        **{d: layout.sizes[d] for d in DIMS},
        "order": "-".join(layout.dims),
        "world_size": layout.world_size,
    }


def layout_of(data: Any) -> Layout | None:
    """The :class:`Layout` of a :func:`layout_dict` (None when ``data`` is not one)."""
    if not isinstance(data, dict):
        return None
    try:
        return Layout(
            int(data["world_size"]),
            **{f"{d}_size": int(data[d]) for d in DIMS},
            order=str(data["order"]),
        )
    except (KeyError, TypeError, ValueError):
        return None


def describe_layout(data: dict[str, Any] | None, world_size: int | None = None) -> str:
    """``tp=1 cp=2 pp=1 dp=2 (order tp-cp-pp-dp, 4 ranks)``; a format-1 checkpoint: ``an unrecorded
    layout``."""
    layout = layout_of(data)
    if layout is None:
        return (
            f"an unrecorded layout of {world_size} rank(s)"
            if world_size
            else "an unrecorded layout"
        )
    return layout.describe()


@dataclass
class Commit:
    """What ``COMMIT`` records: the step, the commit order, who saved it, and what it holds.

    ``entries`` maps each entry of the saved state to ``{"kind", "scope"}`` (kind: module,
    optimizer, generator, stateful, plain; scope: sharded for modules and optimizers).
    """

    step: int
    world_size: int
    seq: int = 0
    time: float = field(default_factory=time.time)
    layout: dict[str, Any] | None = None
    entries: dict[str, dict[str, str]] = field(default_factory=dict)
    format: int = FORMAT

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "seq": self.seq,
            "world_size": self.world_size,
            "time": self.time,
            "format": self.format,
            "layout": self.layout,
            "entries": self.entries,
        }


MAX_COMMIT_BYTES = 1 << 20
"""The largest ``COMMIT`` read: a few hundred bytes normally."""
_COMMIT_FIELDS: dict[str, tuple[type, ...]] = {
    "step": (int,),
    "world_size": (int,),
    "seq": (int, type(None)),
    "time": (int, float, type(None)),
    "format": (int, type(None)),
    "layout": (dict, type(None)),
    "entries": (dict, type(None)),
}
_LIMITS = {"step": (0, 1 << 62), "world_size": (1, 1 << 24), "seq": (0, 1 << 62), "format": (1, 99)}


def _check_commit(data: Any) -> dict[str, Any]:
    """``COMMIT``'s fields, each of its type and in its range (ValueError naming the first that
    is not)."""
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    for key, types in _COMMIT_FIELDS.items():
        value = data.get(key)
        if type(value) not in types:
            raise ValueError(
                f"{key} = {str(value)[:40]!r} is not allowed: expected {types[0].__name__}"
            )
        low, high = _LIMITS.get(key, (0, 1 << 62))
        if type(value) is int and not low <= value <= high:
            raise ValueError(f"{key} = {str(value)[:40]} is not allowed: from {low} to {high}")
        if type(value) is float and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{key} = {value} is not allowed: a finite time")
    return data


def read_commit(directory: Path) -> Commit:
    """The checkpoint's ``COMMIT``; :class:`CheckpointUnreadable` naming the file and the field
    when it is not valid (a regular file of at most 1 MiB, each field typed and in range)."""
    path = directory / COMMIT_FILE
    try:
        data = _check_commit(json.loads(read_bytes(path, MAX_COMMIT_BYTES)))
    except RecursionError:
        raise CheckpointUnreadable(f"{path}: JSON nested too deeply") from None
    except (OSError, ValueError) as exc:
        raise CheckpointUnreadable(f"{path}: {type(exc).__name__}: {exc}") from None
    return Commit(
        step=data["step"],
        world_size=data["world_size"],
        seq=data.get("seq") or 0,
        time=float(data.get("time") or 0),
        layout=data.get("layout"),
        entries=data.get("entries") or {},
        format=data.get("format") or 1,
    )


def fsync_path(path: Path) -> None:
    """fsync a file or directory (a directory: so the names in it survive a power loss)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_commit(directory: Path, commit: Commit) -> None:
    """Write ``COMMIT`` durably: ``.part``, fsync, rename, fsync the directory."""
    part = directory / (COMMIT_FILE + ".part")
    with open(part, "w") as f:
        f.write(json.dumps(commit.to_json()) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, directory / COMMIT_FILE)
    fsync_path(directory)


@dataclass(frozen=True)
class Candidate:
    """A complete checkpoint directory: its step, path, commit order (``seq``, ``time``), readable
    ``COMMIT``."""

    step: int
    path: Path
    seq: float
    time: float
    readable: bool

    @property
    def order(self) -> tuple[float, float, int]:
        return self.seq, self.time, self.step


def _candidate(step: int, path: Path) -> Candidate:
    try:
        commit = read_commit(path)
        return Candidate(step, path, commit.seq, commit.time, True)
    except (
        CheckpointUnreadable
    ):  # a torn COMMIT in step_X: most likely the newest write (tried first, falls back)
        try:
            mtime = (path / COMMIT_FILE).stat().st_mtime
        except OSError:
            mtime = 0.0
        return Candidate(
            step, path, float("-inf") if path.name.startswith(".") else float("inf"), mtime, False
        )


def candidates(root: Path) -> dict[int, list[Candidate]]:
    """Every complete copy of every step under ``root`` (visible and hidden), each step's newest
    commit first."""
    found: dict[int, list[Candidate]] = {}
    try:
        entries = list(root.iterdir())
    except OSError:
        return found
    for p in entries:
        step = parse_step(p.name)
        hidden = hidden_step(p.name) if step is None else None
        if hidden is not None and any(k in p.name for k in _HIDDEN_COMPLETE):
            step = hidden[0]
        elif step is None:
            continue
        if p.is_dir() and (p / COMMIT_FILE).is_file():
            found.setdefault(step, []).append(_candidate(step, p))
    for copies in found.values():
        copies.sort(key=lambda c: (c.order, not c.path.name.startswith(".")), reverse=True)
    return found


def complete_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of the complete checkpoints under ``run_dir``, in commit order (the newest
    last).

    One entry per step: its newest committed copy (normally ``step_XXXXXXXX``; a hidden
    copy when a crash hit a save of that step between its two renames).
    """
    root = Path(run_dir) / files.CHECKPOINTS
    best = [copies[0] for copies in candidates(root).values()]
    return [(c.step, c.path) for c in sorted(best, key=lambda c: c.order)]
