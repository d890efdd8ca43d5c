"""Failure records: what a failing rank leaves in ``logs/rank{r}.error.json``, and reading them back."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from . import files
from .io import atomic_write_json

__all__ = ["PEER_LOSS", "is_peer_loss_message", "load_failure_records", "write_failure_record"]

PEER_LOSS = re.compile(r"connection closed by peer|connection reset|broken pipe|"
                       r"ProcessGroup.*abort|NCCL communicator was aborted", re.IGNORECASE)
"""Messages that only say another rank went away (a consequence, not a cause)."""


def is_peer_loss_message(message: str) -> bool:
    return bool(PEER_LOSS.search(message or ""))


def write_failure_record(run_dir: Path | str, rank: int, record: dict[str, Any]) -> None:
    """Write rank ``rank``'s failure record atomically."""
    atomic_write_json(files.rank_error(run_dir, rank), record)


def load_failure_records(run_dir: Path | str) -> list[dict[str, Any]]:
    """The failure records of the last attempt (restarts leave older ones behind), oldest first."""
    records = []
    for path in files.rank_errors(run_dir):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            records.append(record)
    last = max((r.get("attempt", 0) for r in records), default=0)
    return sorted((r for r in records if r.get("attempt", 0) == last), key=lambda r: r.get("time", 0.0))
