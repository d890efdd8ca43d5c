"""Exit records: how each rank of a task that starts its own process group ended
(``logs/rank{r}.exit.json``).

A script run under ``task=script`` (or a function under ``task=call``) brings its own
process group, or none at all, so its ranks cannot gather their results with a
collective once it returned. Each rank instead writes an exit record (atomically)
and rank 0 waits until it has one from every rank of the same attempt, then writes
``result.json`` from them. A record of an earlier attempt (a restart, a requeue, a
resume) is never taken for this one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import files
from .io import atomic_write_json, read_json

__all__ = ["read_exits", "wait_for_exits", "write_exit"]


def write_exit(run_dir: Path | str, rank: int, attempt: int, **fields: Any) -> None:
    """Rank ``rank``'s exit record of ``attempt``: ``exit_code``, ``result``, ``timings``, ``host``,
    ``coords``."""
    atomic_write_json(
        files.rank_exit(run_dir, rank),
        {"rank": rank, "attempt": attempt, **fields, "time": time.time()},
    )


def _read(path: Path) -> dict[str, Any] | None:
    try:
        record = read_json(path)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def read_exits(run_dir: Path | str, world_size: int, attempt: int) -> dict[int, dict[str, Any]]:
    """The exit records of ``attempt`` found now, by rank."""
    out = {}
    for rank in range(world_size):
        record = _read(files.rank_exit(run_dir, rank))
        if record is not None and record.get("attempt") == attempt:
            out[rank] = record
    return out


def wait_for_exits(
    run_dir: Path | str,
    world_size: int,
    attempt: int,
    poll_s: float = 0.002,
    max_poll_s: float = 0.02,
    on_wait: Callable[[list[int]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every rank's exit record of ``attempt``, in rank order, once all exist.

    Waits as long as it takes: a rank that fails or hangs is the launcher's to handle
    (it stops this rank too). ``on_wait(missing)`` is called about every 10 s while
    ranks are missing. Polls from ``poll_s``, backing off to ``max_poll_s``.
    """
    found: dict[int, dict[str, Any]] = {}
    delay, last_note = poll_s, time.monotonic()
    while True:
        for rank in range(world_size):
            if rank not in found:
                record = _read(files.rank_exit(run_dir, rank))
                if record is not None and record.get("attempt") == attempt:
                    found[rank] = record
        if len(found) == world_size:
            return [found[r] for r in range(world_size)]
        if on_wait is not None and time.monotonic() - last_note >= 10.0:
            last_note = time.monotonic()
            on_wait(sorted(set(range(world_size)) - set(found)))
        time.sleep(delay)
        delay = min(max_poll_s, delay * 2)
