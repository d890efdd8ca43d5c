"""Attempt records: one entry per try of a run, and what each try lost.

A run may take several attempts: a local elastic restart after a crashed rank
(``launcher.max_restarts``), a SLURM requeue after the preemption warning, or a
relaunch into the same run directory (``launcher.resume=true``). Every attempt
leaves ``logs/attempt{N}.json`` (written atomically, merged field by field):

- rank 0 writes ``started_at`` when it joins, ``resumed_from`` when
  :meth:`~wf_launch.checkpoint.Checkpointer.load` loads a checkpoint (its step, or
  null on a fresh start), with ``layout_from`` / ``layout_to`` when that checkpoint was
  saved at another layout than the attempt's (both null otherwise), and ``ended_at`` /
  ``last_step`` / ``ended_by`` when it leaves in an orderly way (returned, stop flag,
  preemption);
- the launcher fills in what a killed rank 0 could not: ``ended_by`` from the ranks'
  exit codes (``rank 2 killed by SIGKILL``) or the signal it got (``SIGTERM``), and
  the last step from the ranks' published progress.

:func:`collect` turns the markers into the ``attempts`` list of ``result.json``:
each entry's ``cause`` is why that attempt began (``launch`` for the first, else how
the one before it ended) and ``steps_lost`` the previous attempt's ``last_step``
minus this one's ``resumed_from`` (work done twice because of that cause).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from worldfoundry.core.validation import is_int, is_number

from . import files
from .failures import culprit
from .io import UnreadableFile, atomic_write_json, read_json
from .progress import read_progress

__all__ = [
    "cause_of_exits",
    "checked",
    "close",
    "collect",
    "count",
    "describe",
    "last_step",
    "numbers",
    "read",
    "update",
]

_FIELDS = (
    "started_at",
    "ended_at",
    "resumed_from",
    "last_step",
    "ended_by",
    "layout_from",
    "layout_to",
)
_CHECKS: dict[str, tuple[Any, str]] = {
    "started_at": (is_number, "a time"),
    "ended_at": (is_number, "a time"),
    "resumed_from": (lambda v: is_int(v) and v >= 0, "a step (an integer >= 0)"),
    "last_step": (lambda v: is_int(v) and v >= 0, "a step (an integer >= 0)"),
    "ended_by": (lambda v: isinstance(v, str), "text"),
    "layout_from": (lambda v: isinstance(v, dict), "a layout (a JSON object)"),
    "layout_to": (lambda v: isinstance(v, dict), "a layout (a JSON object)"),
}


def checked(path: Path | str) -> dict[str, Any] | None:
    """The marker at ``path`` (None when absent), each field checked; :class:`UnreadableFile` names
    what is wrong."""
    data = read_json(path)
    if data is None:
        return None
    if not isinstance(data, dict):
        raise UnreadableFile(path, f"expected a JSON object, found {type(data).__name__}")
    for key, (ok, what) in _CHECKS.items():
        value = data.get(key)
        if value is not None and not ok(value):
            raise UnreadableFile(path, f"{key}={value!r:.60} is not {what}")
    return data


def read(run_dir: Path | str, attempt: int) -> dict[str, Any] | None:
    """Attempt ``attempt``'s marker (None when there is none, or it is unreadable or malformed)."""
    try:
        return checked(files.attempt_file(run_dir, attempt))
    except (OSError, ValueError):
        return None


def update(
    run_dir: Path | str, attempt: int, overwrite: bool = True, **fields: Any
) -> dict[str, Any]:
    """Merge ``fields`` into attempt ``attempt``'s marker and write it atomically.

    With ``overwrite=False`` a field already recorded keeps its value (the launcher
    fills gaps; it never replaces what rank 0 knew first-hand).
    """
    marker = read(run_dir, attempt) or {"attempt": attempt}
    for key, value in fields.items():
        if overwrite or marker.get(key) is None:
            marker[key] = value
    atomic_write_json(files.attempt_file(run_dir, attempt), marker)
    return marker


def numbers(run_dir: Path | str) -> list[int]:
    """The attempt numbers the run directory has markers for, in order (gaps and all)."""
    logs = Path(run_dir) / files.LOGS
    try:
        paths = list(logs.glob("*.json")) if logs.is_dir() else []
    except OSError:
        return []
    return sorted(n for p in paths if (n := files.attempt_number(p)) is not None)


def count(run_dir: Path | str) -> int:
    """How many attempts the run directory has recorded (the next attempt's number)."""
    found = numbers(run_dir)
    return found[-1] + 1 if found else 0


def last_step(run_dir: Path | str, world_size: int, since: float | None = None) -> int | None:
    """The furthest step any rank published (``ctx.progress``), counting only reports after
    ``since``."""

    steps = [
        s["step"]
        for s in read_progress(run_dir, world_size).values()
        if since is None or float(s.get("time") or 0) >= since
    ]
    return max(steps) if steps else None


def cause_of_exits(exits: dict[int, int]) -> str:
    """A crashed attempt's cause from the ranks' exit codes (see :func:`culprit`)."""
    if not exits:
        return "failed"
    rank = culprit(exits)
    code = exits[rank]
    if code < 0:
        try:
            return f"rank {rank} killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"rank {rank} killed by signal {-code}"
    return f"rank {rank} exited with code {code}"


def close(run_dir: Path | str, attempt: int, world_size: int, ended_by: str) -> dict[str, Any]:
    """The launcher's view of an attempt that has just ended: fill the gaps rank 0 left.

    ``last_step`` becomes the furthest of rank 0's own record, every rank's published progress and
    the step the attempt resumed from (an attempt that made no step ended where it began).
    A marker that cannot be written (a full disk) raises ``OSError`` only after the merged marker
    is known: every launcher catches it and goes on to record the run.
    """
    marker = read(run_dir, attempt) or {}
    steps = [
        s
        for s in (
            marker.get("last_step"),
            last_step(run_dir, world_size, marker.get("started_at")),
            marker.get("resumed_from"),
        )
        if s is not None
    ]
    update(run_dir, attempt, overwrite=False, ended_by=ended_by, ended_at=time.time())
    return update(run_dir, attempt, last_step=max(steps) if steps else None)


def collect(run_dir: Path | str, problems: list[str] | None = None) -> list[dict[str, Any]]:
    """Every recorded attempt, oldest first, with ``steps_lost`` against the attempt before it.

    Only the markers that exist are read (a stray ``attempt999999999.json`` costs one read,
    not a billion); a malformed one is left out, and ``problems`` (if given) gets
    ``unreadable: FILE, why`` for it.
    """
    out: list[dict[str, Any]] = []
    previous: dict[str, Any] | None = None
    for n in numbers(run_dir):
        try:
            marker = checked(files.attempt_file(run_dir, n))
        except (OSError, ValueError) as exc:
            if problems is not None:
                problems.append(
                    f"unreadable: {files.attempt_file(run_dir, n)}, "
                    f"{getattr(exc, 'why', None) or exc}"
                )
            continue
        if marker is None:
            continue
        lost = None
        if previous is not None and previous.get("last_step") is not None:
            lost = max(0, previous["last_step"] - (marker.get("resumed_from") or 0))
        cause = "launch" if previous is None else str(previous.get("ended_by") or "unknown")
        out.append(
            {
                "attempt": n,
                "cause": cause,
                **{key: marker.get(key) for key in _FIELDS},
                "steps_lost": lost,
            }
        )
        previous = marker
    return out


def describe(entries: list[dict[str, Any]]) -> list[str]:
    """One line per attempt, for ``python -m wf_launch.status`` and the drill."""

    def show(value: Any) -> str:
        return "-" if value is None else str(value)

    return [
        f"attempt {a.get('attempt')}: {a.get('cause')}; resumed from step "
        f"{show(a.get('resumed_from'))}"
        f"{_layout_change(a)}, reached step {show(a.get('last_step'))}, steps lost "
        f"{show(a.get('steps_lost'))}; "
        f"ended by {show(a.get('ended_by'))}"
        for a in entries
    ]


def _layout_change(entry: dict[str, Any]) -> str:
    """`` at a new layout (dp=4 -> cp=2 dp=2)`` when the attempt resumed at another layout, else
    nothing."""
    before, after = entry.get("layout_from"), entry.get("layout_to")
    if not (isinstance(before, dict) and isinstance(after, dict)):
        return ""

    def sizes(layout: dict[str, Any]) -> str:
        shown = [
            f"{d}={layout.get(d)}"
            for d in ("tp", "cp", "pp", "dp")
            if layout.get(d) not in (1, None)
        ]
        return " ".join(shown) or "1 rank"

    return f" at a new layout ({sizes(before)} -> {sizes(after)})"
