"""Failure records: what a failing rank leaves in ``logs/rank{r}.error.json``, and reading them
back."""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

from worldfoundry.core.validation import is_int, is_number

from . import files
from .io import atomic_write_json, read_json
from .space import using_reserve

__all__ = [
    "PEER_LOSS",
    "culprit",
    "is_peer_loss_message",
    "load_failure_records",
    "valid_failure_record",
    "write_failure_record",
]

PEER_LOSS = re.compile(
    r"connection closed by peer|connection reset|broken pipe|"
    r"ProcessGroup.*abort|NCCL communicator was aborted",
    re.IGNORECASE,
)
"""Messages that only say another rank went away (a consequence, not a cause)."""


def is_peer_loss_message(message: str) -> bool:
    return bool(PEER_LOSS.search(message or ""))


def culprit(exits: dict[int, int]) -> int | None:
    """The rank whose exit explains its peers' (``exits``: rank -> exit code, < 0 a signal).

    A rank killed by a signal other than SIGTERM (kill -9, a segfault, the OOM
    killer) comes first: it cannot leave a record and its peers' errors follow
    from it. Then the lowest rank that exited non-zero on its own. SIGTERM comes
    last: it is how an agent stops the survivors of a failure.
    """
    if not exits:
        return None

    def order(rank: int) -> tuple[int, int]:
        code = exits[rank]
        if code == -signal.SIGTERM:
            return 2, rank
        return (0 if code < 0 else 1), rank

    return min(exits, key=order)


def write_failure_record(run_dir: Path | str, rank: int, record: dict[str, Any]) -> None:
    """Write rank ``rank``'s failure record atomically (on a full disk, in the run's reserve)."""
    using_reserve(run_dir, lambda: atomic_write_json(files.rank_error(run_dir, rank), record))


def valid_failure_record(record: Any, rank: int | None = None) -> bool:
    """Whether ``record`` has the fields of a failure record with the types every reader relies
    on."""
    if not isinstance(record, dict) or not (is_int(record.get("rank")) and record["rank"] >= 0):
        return False
    if rank is not None and record["rank"] != rank:
        return False
    texts = all(
        isinstance(record.get(k, ""), str) for k in ("kind", "type", "message", "traceback", "log")
    )
    return (
        texts
        and is_number(record.get("time", 0.0))
        and is_int(record.get("attempt", 0))
        and isinstance(record.get("coords", {}), dict)
    )


def load_failure_records(run_dir: Path | str) -> list[dict[str, Any]]:
    """The failure records of the last attempt (restarts leave older ones behind), oldest first.

    A record that cannot be read, or whose fields have the wrong types (or another rank's
    number than its file's), is left out: the root cause is built from the others.
    """
    records = []
    for path in files.rank_errors(run_dir):
        digits = path.name.removeprefix("rank").split(".", 1)[0]
        try:
            record = read_json(path, 16 << 20)
        except (OSError, ValueError):
            continue
        if digits.isdigit() and valid_failure_record(record, int(digits)):
            records.append(record)
    last = max((r.get("attempt", 0) for r in records), default=0)
    return sorted(
        (r for r in records if r.get("attempt", 0) == last), key=lambda r: r.get("time", 0.0)
    )
