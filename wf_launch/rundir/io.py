"""Atomic writes and JSON reads: readers of a run directory see an old file or the whole new one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_json", "atomic_write_text", "read_json"]


def atomic_write_text(path: Path | str, text: str) -> None:
    """Write ``text`` to ``path`` so readers see the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path | str, data: Any) -> None:
    """JSON-encode ``data`` (indent 2, keys in order given) and write it atomically."""
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def read_json(path: Path | str) -> Any:
    """Parsed JSON at ``path``, or None if it does not exist."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
