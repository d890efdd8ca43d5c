"""The run directory: atomic writes, per-rank file names, environment facts."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["CONFIG", "ENVIRONMENT", "LAUNCHER_LOG", "LOCK", "LOGS", "MARKERS", "RESULT", "RunDirClaim", "RunDirInUse", "atomic_write_json", "atomic_write_text", "claim", "environment_info", "launch_alive", "rank_error", "rank_log", "read_json", "record_environment"]

RESULT = "result.json"
LOCK = ".wf_launch.lock"
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


class RunDirInUse(Exception):
    """The run directory already holds a run, or a live launch owns it."""


MARKERS = (RESULT, CONFIG, LAUNCHER_LOG, LOGS, "slurm_job.json")
"""What a launch leaves in its run directory: any of them means the directory holds a run."""


def _held_by(run_dir: Path) -> str | None:
    existing = [m for m in MARKERS if (run_dir / m).exists()]
    if not existing:
        return None
    try:
        data = read_json(run_dir / RESULT)
        what = f"status {data.get('status')!r}" if isinstance(data, dict) else "no result.json yet"
    except (OSError, ValueError):
        what = "an unreadable result.json"
    return f"{what}; holds {', '.join(existing)}"


class RunDirClaim:
    """An exclusive claim on a run directory for one launch (a lock file held until :meth:`release`)."""

    def __init__(self, run_dir: Path, fd: int | None) -> None:
        self.run_dir = run_dir
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDirClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim(run_dir: Path, overwrite: bool = False, resume: bool = False) -> RunDirClaim:
    """Make ``run_dir`` this launch's own: one run directory holds one run.

    Raises :class:`RunDirInUse` when a live launch holds the directory's lock, or
    when the directory already holds a run (its ``result.json``, logs, config)
    and neither ``overwrite`` nor ``resume`` is set. With ``overwrite`` the old run is moved aside into
    a sibling ``NAME.replaced-TIMESTAMP`` directory, never merged into. With
    ``resume`` the launch continues that run in place (its checkpoints and attempt
    records stay; its last ``result.json`` moves to ``logs/``), unless it completed.
    """
    import fcntl

    if overwrite and resume:
        raise RunDirInUse("launcher.overwrite=true and launcher.resume=true: choose one (overwrite moves the run "
                          "in the directory aside, resume continues it)")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise RunDirInUse(f"run directory {run_dir} is in use by a live launch (pid {holder}); "
                          "choose another hydra.run.dir") from None
    held = _held_by(run_dir)
    if held and resume:
        _resumable(run_dir, fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return RunDirClaim(run_dir, fd)
    if held and not overwrite:
        os.close(fd)
        raise RunDirInUse(f"run directory {run_dir} already holds a run ({held}); choose another "
                          "hydra.run.dir, or pass launcher.overwrite=true to move that run aside")
    if held:
        aside = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        aside.mkdir()
        for entry in run_dir.iterdir():
            if entry.name not in (LOCK, ".hydra"):
                entry.rename(aside / entry.name)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return RunDirClaim(run_dir, fd)


def _resumable(run_dir: Path, fd: int) -> None:
    """Check that the run in ``run_dir`` can be continued, and move its last record into ``logs/``."""
    try:
        data = read_json(run_dir / RESULT)
    except (OSError, ValueError):
        data = None
    status = data.get("status") if isinstance(data, dict) else None
    if status == "ok" and "exit_code" in data:
        os.close(fd)
        raise RunDirInUse(f"run directory {run_dir} holds a run that completed (status 'ok'); nothing to "
                          "resume: choose another hydra.run.dir, or launcher.overwrite=true to start afresh")
    if data is not None:
        previous = len(list((run_dir / LOGS).glob("attempt*.json")))
        (run_dir / LOGS).mkdir(exist_ok=True)
        os.replace(run_dir / RESULT, run_dir / LOGS / f"result.before-attempt{previous}.json")


def launch_alive(run_dir: Path) -> bool:
    """Whether the process that claimed ``run_dir`` (the pid in its lock file) still lives on this host."""
    try:
        pid = int((Path(run_dir) / LOCK).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


MAX_DIFF_BYTES = 256 * 1024
MAX_PACKAGES = 5000


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
    atomic_write_json(Path(run_dir) / ENVIRONMENT, full)
    return {**info, "details": ENVIRONMENT}
