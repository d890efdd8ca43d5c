"""One run directory holds one run: the launch's claim on it (a lock file), overwrite and resume.

The claim is an ``flock`` on ``.wf_launch.lock``, held until the launcher exits; the
file names the holder (``PID HOST``). Whether a run's launch is alive is a test of
the lock itself (:func:`launch_alive`), never of the pid alone: a pid is reused after
a kill -9, and a pid from another host means nothing here. An ``flock`` is seen by
every host of a shared file system that supports locks (NFS, Lustre with ``flock``,
GPFS, CephFS); where locks do not work, a run of another host is taken to be alive.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from . import files
from .attempts import count
from .io import open_regular
from .record import RecordError, RunRecord, Status
from .resume import resume_hint

__all__ = [
    "OWNER_ONLY",
    "RunDirClaim",
    "RunDirInUse",
    "claim",
    "claim_tool_dir",
    "close_runs",
    "launch_alive",
    "lock_holder",
    "make_private",
    "private_umask",
    "refuse_shared",
    "remove_made_folders",
    "restore_record",
]

OWNER_ONLY = 0o700
"""The mode of a run directory until its config is known to be valid (then
``launcher.run_dir_mode``)."""

_LOCK_RETRY_S = 0.5
"""How long a claim retries a lock that is busy: a reader testing the lock holds it for an
instant."""


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
    """An exclusive claim on a run directory for one launch (a lock file held until
    :meth:`release`)."""

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


def lock_holder(run_dir: Path | str) -> tuple[int | None, str | None]:
    """The pid and host the run directory's lock file names (None where it names none)."""
    try:
        with open(open_regular(Path(run_dir) / files.LOCK), "rb") as f:
            words = f.read(512).decode(errors="replace").split()
    except (OSError, ValueError):
        return None, None
    pid = (
        int(words[0])
        if words and words[0].isascii() and words[0].isdigit() and len(words[0]) < 10
        else None
    )
    return pid, (words[1] if len(words) > 1 else None)


def _lock(run_dir: Path, advice: str = "choose another hydra.run.dir") -> int:
    """The run directory's lock, held (flock) by this process, naming it; :class:`RunDirInUse`
    when a live launch holds it (``advice`` ends the message)."""
    import fcntl

    try:
        fd = os.open(
            run_dir / files.LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
        )
    except OSError as exc:
        raise RunDirInUse(
            f"run directory {run_dir}: cannot open its lock file {files.LOCK} "
            f"({exc.strerror or exc}); {advice}"
        ) from None
    deadline = time.monotonic() + _LOCK_RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            pid, host = lock_holder(run_dir)
            os.close(fd)
            raise RunDirInUse(
                f"run directory {run_dir} is in use by a live launch (pid {pid or '?'}"
                f"{f' on {host}' if host and host != socket.gethostname() else ''}); {advice}"
            ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return fd


def claim(
    run_dir: Path,
    overwrite: bool = False,
    resume: bool | str = False,
    is_live: Callable[[Path], bool] | None = None,
) -> RunDirClaim:
    """Make ``run_dir`` this launch's own: one run directory holds one run.

    Raises :class:`RunDirInUse` when a live launch holds the directory's lock, or when the directory
    already holds a run (its ``result.json``, logs, config) and neither ``overwrite`` nor ``resume``
    is set. With ``overwrite`` the old run is moved aside into a sibling ``NAME.replaced-TIMESTAMP``
    directory (mode 0700), never merged into. With ``resume`` the launch continues that run in place
    (its checkpoints and attempt records stay; its last ``result.json`` moves to ``logs/``), unless
    it completed; when the directory holds no run, ``resume=True`` is refused (naming the run
    directories close to its name: a typo would otherwise train from scratch) and ``resume="auto"``
    starts one. Either is refused while the run may still be going: ``is_live(run_dir)`` is its
    launcher's :meth:`~wf_launch.launchers.LauncherHooks.is_live` (a detached SLURM job whose
    launcher has left still runs). Once claimed, the directory is made owner-only (0700).
    """
    if overwrite and resume:
        raise RunDirInUse(
            "launcher.overwrite=true and launcher.resume=true: choose one (overwrite moves the run "
            "in the directory aside, resume continues it)"
        )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _refuse_foreign(run_dir)
    fd = _lock(run_dir)
    try:
        held = _held_by(run_dir)
        resume = _resumes(run_dir, resume, held)
        if held and (overwrite or resume) and is_live is not None:
            _refuse_if_live(
                run_dir, is_live, "launcher.resume=true" if resume else "launcher.overwrite=true"
            )
        if held and resume:
            _resumable(run_dir)
        elif held and not overwrite:
            raise RunDirInUse(
                f"run directory {run_dir} already holds a run ({held}); choose another "
                "hydra.run.dir, or pass launcher.overwrite=true to move that run aside"
                + _or_resume(run_dir)
            )
        elif held:
            _move_aside(run_dir)
        os.chmod(run_dir, OWNER_ONLY)
    except BaseException:
        if not _held_by(run_dir):  # refused or interrupted: no run here, so no lock file either
            (run_dir / files.LOCK).unlink(missing_ok=True)
        os.close(fd)
        raise
    return RunDirClaim(run_dir, fd)


def _refuse_foreign(run_dir: Path) -> None:
    """:class:`RunDirInUse` when ``run_dir`` belongs to another user: they could read or replace
    every file of the run (and it cannot be made owner-only)."""
    owner = run_dir.stat().st_uid
    if owner != os.getuid():
        raise RunDirInUse(
            f"run directory {run_dir} is owned by uid {owner}, not by you (uid {os.getuid()}): "
            "its owner could read or replace the run's files; choose another hydra.run.dir"
        )


def _refuse_if_live(run_dir: Path, is_live: Callable[[Path], bool], what: str) -> None:
    """:class:`RunDirInUse` unless the run in ``run_dir`` has ended (its launcher says so)."""
    try:
        live = is_live(run_dir)
    except (OSError, ValueError) as exc:
        raise RunDirInUse(
            f"run directory {run_dir}: cannot tell whether its run has ended ({exc}); {what} "
            "refused"
        ) from None
    if live:
        raise RunDirInUse(
            f"run directory {run_dir} holds a run that is still going; {what} would move or write "
            "its files under it: wait for it to end, or cancel it first (python -m "
            "wf_launch.status "
            f"--cancel {run_dir})"
        )


def _resumes(run_dir: Path, resume: bool | str, held: str | None) -> bool:
    """Whether the launch continues the run there: ``resume`` is True or "auto" and one is;
    True where none is (a typo) is refused."""
    if resume is True and not held:
        _refuse_no_run(run_dir)
    return bool(held) and resume in (True, "auto")


def _refuse_no_run(run_dir: Path) -> None:
    """:class:`RunDirInUse`: ``launcher.resume=true`` into a directory that holds no run."""
    near = close_runs(run_dir)
    raise RunDirInUse(
        f"launcher.resume=true: there is no run in {run_dir} to resume"
        + (f"; did you mean {' or '.join(map(str, near))}?" if near else "")
        + " (launcher.resume=auto starts a run when none is there)"
    )


def close_runs(run_dir: Path, n: int = 3) -> list[Path]:
    """The run directories beside ``run_dir`` with names closest to its name (a typo's target)."""
    import difflib

    parent = run_dir.parent
    try:
        names = [
            d.name
            for d in parent.iterdir()
            if d.is_dir() and d != run_dir and any((d / m).exists() for m in files.MARKERS)
        ]
    except OSError:
        return []
    return [parent / m for m in difflib.get_close_matches(run_dir.name, names, n=n, cutoff=0.6)]


def _or_resume(run_dir: Path) -> str:
    """'; or continue it ...: python -m wf_launch ... launcher.resume=true ...' when the run can go
    on."""

    hint = resume_hint(run_dir)
    return f"; or {hint}" if hint else ""


def _move_aside(run_dir: Path) -> None:
    aside = run_dir.with_name(
        f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    )
    aside.mkdir(mode=OWNER_ONLY)
    os.chmod(aside, OWNER_ONLY)  # whatever the umask
    for entry in run_dir.iterdir():
        if entry.name != files.LOCK:
            entry.rename(aside / entry.name)


def _resumable(run_dir: Path) -> None:
    """Check that the run in ``run_dir`` can be continued, and move its last record into
    ``logs/``."""

    path = RunRecord.path(run_dir)
    try:
        record = RunRecord.read(run_dir)
    except RecordError:
        record = None
    if record is not None and record.status is Status.OK and record.final:
        raise RunDirInUse(
            f"run directory {run_dir} holds a run that completed (status 'ok'); nothing to "
            "resume: choose another hydra.run.dir, or launcher.overwrite=true to start afresh"
        )
    if path.exists():
        (run_dir / files.LOGS).mkdir(exist_ok=True)
        os.replace(path, files.result_before_attempt(run_dir, count(run_dir)))


def restore_record(run_dir: Path) -> bool:
    """Put back the record a resume moved into ``logs/`` (the resume could not even write its own,
    on a full disk): ``status`` then shows how the run ended, and why. Whether it did."""
    path = RunRecord.path(run_dir)
    before = files.result_before_attempt(run_dir, count(run_dir))
    if path.exists() or not before.is_file():
        return False
    try:
        os.replace(before, path)
    except OSError:
        return False
    return True


def launch_alive(run_dir: Path | str) -> bool:
    """Whether the launch that claimed ``run_dir`` still holds its lock (another process than this
    one).

    The lock itself is tested (a shared ``flock``, taken and dropped at once): a process
    that died released it, whatever its pid became since. Where the file system has no
    working locks, the pid is asked instead on its own host, and a run of another host
    is taken to be alive (nothing here can tell).
    """
    import fcntl

    path = Path(run_dir) / files.LOCK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except OSError:
        return _pid_alive(*lock_holder(run_dir))
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        pid, host = lock_holder(run_dir)
        return not (
            pid == os.getpid() and host == socket.gethostname()
        )  # our own claim is not a live run
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        return _pid_alive(*lock_holder(run_dir))
    finally:
        os.close(fd)
    return False


def _pid_alive(pid: int | None, host: str | None) -> bool:
    """Without working locks: a pid of this host that exists (it may be reused); a run of another
    host is alive."""
    if not pid:
        return False
    if host is not None and host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def remove_made_folders(path: Path, since: float) -> None:
    """Remove ``path`` and its parents while each is an empty folder made after ``since`` (Hydra
    makes the run directory before the app runs; a dry run leaves nothing). Never the working
    directory or one above it."""
    cwd = Path.cwd().resolve()
    path = path.resolve()
    while path != cwd and path not in cwd.parents and path.parent != path:
        try:
            if path.stat().st_mtime < since - 0.05 or any(path.iterdir()):
                return
            path.rmdir()
        except OSError:
            return
        path = path.parent


def refuse_shared(directory: Path, option: str, record: str) -> None:
    """:class:`RunDirInUse` unless ``directory`` and its ``record`` file are this user's own and
    writable by no one else: a record someone else could have changed is not acted on."""
    for path in (directory, directory / record):
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise RunDirInUse(f"{option} {directory}: {path}: {exc.strerror or exc}") from None
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise RunDirInUse(
                f"{option} {directory}: {path} is owned by uid {info.st_uid} with mode "
                f"{info.st_mode & 0o7777:04o}: someone else could have changed it; check it, "
                f"then make it yours and not writable by others (chmod go-w) to go on"
            )


def claim_tool_dir(directory: Path, option: str) -> RunDirClaim:
    """A tune's or a drill's directory, made owner-only (0700) and locked by this process for its
    life: :class:`RunDirInUse` (one line) when another live tool holds it or it is not ours."""
    directory = Path(directory)
    try:
        make_private(directory)
    except OSError as exc:
        raise RunDirInUse(
            f"{option} {directory}: cannot make it owner-only ({exc.strerror or exc}); "
            f"choose another {option}"
        ) from None
    if directory.stat().st_uid != os.getuid():
        raise RunDirInUse(
            f"{option} {directory}: owned by uid {directory.stat().st_uid}, not by you; "
            f"choose another {option}"
        )
    return RunDirClaim(directory, _lock(directory, f"choose another {option}"))


def make_private(path: Path, mode: int = OWNER_ONLY) -> None:
    """Create the folder ``path`` (and its parents) if needed, and give it ``mode`` whatever the
    umask."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    os.chmod(path, mode)


def private_umask() -> None:
    """Nothing this process (or a rank or job it starts) creates is writable by anyone but its
    owner.

    Files and folders of a run are read (and some executed: submitit's pickles, the code
    snapshot) by the launcher and the job; with a group-writable umask a group member could
    replace them. Read access still follows the umask and ``launcher.run_dir_mode``.
    """
    os.umask(os.umask(0o077) | 0o022)
