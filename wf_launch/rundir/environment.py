"""``environment.json``: versions, host, packages and the code's git state, for the run record."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import files
from .io import atomic_write_json

__all__ = ["MAX_DIFF_BYTES", "environment_info", "record_environment"]

MAX_DIFF_BYTES = 256 * 1024
MAX_PACKAGES = 5000


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


def _packages() -> list[str]:
    """``pip freeze`` of this interpreter (``name==version``, sorted), read from the installed metadata."""
    from importlib import metadata

    found = set()
    for dist in metadata.distributions():
        name = dist.metadata.get("Name")
        if name:
            found.add(f"{name}=={dist.version}")
    return sorted(found, key=str.lower)[:MAX_PACKAGES]


def record_environment(run_dir: Path | str, cwd: Path | str | None = None) -> dict[str, Any]:
    """Write ``environment.json`` (:func:`environment_info` plus the installed packages, ``pip freeze``
    style, and ``git diff HEAD`` when the checkout is dirty, cut at :data:`MAX_DIFF_BYTES`) and return
    the summary the run record keeps (without those two)."""
    info = environment_info(cwd)
    full = {**info, "packages": _packages()}
    if info.get("git_dirty"):
        diff = _git(["diff", "HEAD"], Path(cwd or os.getcwd())) or ""
        data = diff.encode()
        full["git_diff"] = data[:MAX_DIFF_BYTES].decode(errors="replace")
        full["git_diff_truncated"] = len(data) > MAX_DIFF_BYTES
    atomic_write_json(Path(run_dir) / files.ENVIRONMENT, full)
    return {**info, "details": files.ENVIRONMENT}
