"""The run directory: atomic writes, per-rank file names, environment facts."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["CONFIG", "ENVIRONMENT", "LAUNCHER_LOG", "LOGS", "RESULT", "atomic_write_json", "atomic_write_text", "environment_info", "rank_error", "rank_log", "read_json"]

RESULT = "result.json"
CONFIG = "config.yaml"
ENVIRONMENT = "environment.json"
LAUNCHER_LOG = "launcher.log"
LOGS = "logs"


def rank_log(run_dir: Path | str, rank: int) -> Path:
    """Where rank ``rank`` logs (every record, tracebacks, faulthandler dumps)."""
    return Path(run_dir) / LOGS / f"rank{rank}.log"


def rank_error(run_dir: Path | str, rank: int) -> Path:
    """Where rank ``rank`` records the exception it failed with."""
    return Path(run_dir) / LOGS / f"rank{rank}.error.json"


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


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment_info(cwd: Path | str | None = None) -> dict[str, Any]:
    """Versions, host and (inside a git checkout) commit and dirty flag, for the run record."""
    import torch

    cwd = Path(cwd or os.getcwd())
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "argv": sys.argv,
        "cwd": str(cwd),
    }
    commit = _git(["rev-parse", "HEAD"], cwd)
    if commit:
        info["git_commit"] = commit
        status = _git(["status", "--porcelain", "--untracked-files=no"], cwd)
        info["git_dirty"] = bool(status)
    return info
