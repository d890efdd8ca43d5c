"""One run directory holds one run: the launch's claim on it (a lock file), overwrite and resume."""

from __future__ import annotations

import os
import time
from pathlib import Path

from . import files
from .record import RecordError, RunRecord, Status

__all__ = ["RunDirClaim", "RunDirInUse", "claim", "launch_alive"]


class RunDirInUse(Exception):
    """The run directory already holds a run, or a live launch owns it."""


def _held_by(run_dir: Path) -> str | None:
    existing = [m for m in files.MARKERS if (run_dir / m).exists()]
    if not existing:
        return None
    try:
        record = RunRecord.read(run_dir)
        what = f"status {str(record.status)!r}" if record is not None else f"no {files.RESULT} yet"
    except RecordError:
        what = f"an unreadable {files.RESULT}"
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


def _lock(run_dir: Path) -> int:
    """The run directory's lock, held (flock) by this process; :class:`RunDirInUse` when a live launch holds it."""
    import fcntl

    fd = os.open(run_dir / files.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise RunDirInUse(f"run directory {run_dir} is in use by a live launch (pid {holder}); "
                          "choose another hydra.run.dir") from None
    return fd


def claim(run_dir: Path, overwrite: bool = False, resume: bool = False) -> RunDirClaim:
    """Make ``run_dir`` this launch's own: one run directory holds one run.

    Raises :class:`RunDirInUse` when a live launch holds the directory's lock, or
    when the directory already holds a run (its ``result.json``, logs, config)
    and neither ``overwrite`` nor ``resume`` is set. With ``overwrite`` the old run is moved aside into
    a sibling ``NAME.replaced-TIMESTAMP`` directory, never merged into. With
    ``resume`` the launch continues that run in place (its checkpoints and attempt
    records stay; its last ``result.json`` moves to ``logs/``), unless it completed.
    """
    if overwrite and resume:
        raise RunDirInUse("launcher.overwrite=true and launcher.resume=true: choose one (overwrite moves the run "
                          "in the directory aside, resume continues it)")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = _lock(run_dir)
    held = _held_by(run_dir)
    try:
        if held and resume:
            _resumable(run_dir)
        elif held and not overwrite:
            raise RunDirInUse(f"run directory {run_dir} already holds a run ({held}); choose another "
                              "hydra.run.dir, or pass launcher.overwrite=true to move that run aside"
                              + _or_resume(run_dir))
        elif held:
            _move_aside(run_dir)
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return RunDirClaim(run_dir, fd)


def _or_resume(run_dir: Path) -> str:
    """'; or continue it ...: python -m wf_launch ... launcher.resume=true ...' when the run can go on."""
    from .resume import resume_hint

    hint = resume_hint(run_dir)
    return f"; or {hint}" if hint else ""


def _move_aside(run_dir: Path) -> None:
    aside = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    aside.mkdir()
    for entry in run_dir.iterdir():
        if entry.name not in (files.LOCK, files.HYDRA):
            entry.rename(aside / entry.name)


def _resumable(run_dir: Path) -> None:
    """Check that the run in ``run_dir`` can be continued, and move its last record into ``logs/``."""
    from .attempts import count

    path = RunRecord.path(run_dir)
    try:
        record = RunRecord.read(run_dir)
    except RecordError:
        record = None
    if record is not None and record.status is Status.OK and record.final:
        raise RunDirInUse(f"run directory {run_dir} holds a run that completed (status 'ok'); nothing to "
                          "resume: choose another hydra.run.dir, or launcher.overwrite=true to start afresh")
    if path.exists():
        (run_dir / files.LOGS).mkdir(exist_ok=True)
        os.replace(path, files.result_before_attempt(run_dir, count(run_dir)))


def launch_alive(run_dir: Path) -> bool:
    """Whether the process that claimed ``run_dir`` (the pid in its lock file) still lives on this host."""
    try:
        pid = int((Path(run_dir) / files.LOCK).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
