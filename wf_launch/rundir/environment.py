"""``environment.json``: versions, host, packages and the code's git state, for the run record."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from worldfoundry.core.distributed.backends import local_gpu_count

from . import files
from .io import atomic_write_json

__all__ = ["MAX_DIFF_BYTES", "code_provenance", "environment_info", "record_environment"]

MAX_DIFF_BYTES = 256 * 1024
MAX_PACKAGES = 5000


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _checkout(path: Path) -> dict[str, Any] | None:
    """The git checkout holding ``path``: its root, commit and dirty flag (None outside one)."""
    folder = path if path.is_dir() else path.parent
    root = _git(["rev-parse", "--show-toplevel"], folder)
    commit = _git(["rev-parse", "HEAD"], folder) if root else None
    if not root or not commit:
        return None
    status = _git(["status", "--porcelain", "--untracked-files=no"], folder)
    return {"git_root": root, "git_commit": commit, "git_dirty": bool(status)}


def _module_file(name: str) -> Path | None:
    from importlib.util import find_spec

    try:
        spec = find_spec(name)
    except (ImportError, ValueError):
        return None
    return (
        Path(spec.origin)
        if spec is not None and spec.origin and spec.origin not in ("built-in", "frozen")
        else None
    )


def code_provenance(config: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Where the code that runs comes from, whatever directory the command was started in: wf_launch
    itself and the task's own code (``task.modules``, a script's ``task.path`` or ``task.module``),
    each with the commit and dirty flag of the git checkout holding it (none for an installed
    package outside a checkout)."""
    from importlib import metadata

    here = Path(__file__).resolve().parents[1]
    try:
        version = metadata.version("worldfoundry-launch")
    except metadata.PackageNotFoundError:
        version = None
    out: dict[str, dict[str, Any]] = {
        "wf_launch": {"path": str(here), "version": version, **(_checkout(here) or {})}
    }
    task = (config or {}).get("task") or {}
    sources = [
        (f"task.modules[{i}]", _module_file(str(m)))
        for i, m in enumerate(task.get("modules") or [])
    ]
    if isinstance(task.get("path"), str):
        sources.append(("task.path", Path(task["path"]).expanduser().resolve()))
    if isinstance(task.get("module"), str):
        sources.append(("task.module", _module_file(task["module"])))
    for key, path in sources:
        if path is not None:
            out[key] = {"path": str(path), **(_checkout(path) or {})}
    return out


def environment_info(
    cwd: Path | str | None = None, config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Versions, host, the code's provenance, and ``git_commit`` / ``git_dirty``: those of the
    task's own code when it lives in a git checkout, else of wf_launch's checkout, else of the
    working directory's."""
    import torch

    cwd = Path(cwd or os.getcwd())
    code = code_provenance(config)
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_available": local_gpu_count() > 0,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "argv": sys.argv,
        "cwd": str(cwd),
        "sources": code,
    }
    ordered = [v for k, v in code.items() if k != "wf_launch"] + [
        code["wf_launch"],
        _checkout(cwd) or {},
    ]
    source = next((c for c in ordered if c.get("git_commit")), None)
    if source is not None:
        info.update(
            git_commit=source["git_commit"],
            git_dirty=source["git_dirty"],
            git_root=source["git_root"],
        )
    return info


def _packages() -> list[str]:
    """``pip freeze`` of this interpreter (``name==version``, sorted), read from the installed
    metadata."""
    from importlib import metadata

    found = set()
    for dist in metadata.distributions():
        name = dist.metadata.get("Name")
        if name:
            found.add(f"{name}=={dist.version}")
    return sorted(found, key=str.lower)[:MAX_PACKAGES]


def record_environment(run_dir: Path | str, cwd: Path | str | None = None) -> dict[str, Any]:
    """Write ``environment.json`` (:func:`environment_info` for the run's config, plus the installed
    packages, ``pip freeze`` style, and ``git diff HEAD`` of the recorded checkout when it is dirty,
    cut at :data:`MAX_DIFF_BYTES`) and return the summary the run record keeps (without those
    two)."""
    info = environment_info(cwd, files.read_config(run_dir))
    full = {**info, "packages": _packages()}
    if info.get("git_dirty"):
        diff = _git(["diff", "HEAD"], Path(info["git_root"])) or ""
        data = diff.encode()
        full["git_diff"] = data[:MAX_DIFF_BYTES].decode(errors="replace")
        full["git_diff_truncated"] = len(data) > MAX_DIFF_BYTES
    atomic_write_json(Path(run_dir) / files.ENVIRONMENT, full)
    summary = {k: v for k, v in info.items() if k != "sources"}
    return {**summary, "details": files.ENVIRONMENT}
