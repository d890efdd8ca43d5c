"""A full disk, told apart from other write failures, so a run's record can name it; and the
room kept for the launcher's last word.

torch's checkpoint writer reports a full disk as ``unexpected pos 704 vs 598`` (its zip
writer's view of a short write), not as ``ENOSPC``: :func:`disk_full` looks for the errno
anywhere in an exception's chain and, failing that, at the free space of the file system.

At the claim a launch writes :data:`~.files.RESERVE` (:data:`RESERVE_BYTES` of zeros,
owner-only); a final ``result.json`` that cannot be written for want of space frees it and is
written again, so a run whose ranks filled the disk still records why it failed. The launch
removes it as it ends. Best effort: a disk already too full to hold it gets none.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from pathlib import Path

from . import files

__all__ = [
    "FULL_BELOW_BYTES",
    "RESERVE_BYTES",
    "disk_full",
    "free_bytes",
    "full_disk_error",
    "no_space",
    "release_space",
    "reserve_space",
    "using_reserve",
]

FULL_BELOW_BYTES = 1 << 20
"""A file system with less than this free (1 MiB) counts as full after a failed write."""

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def no_space(exc: BaseException | None) -> bool:
    """Whether ``exc``, its causes, or the per-rank failures a ``CheckpointException`` holds, are
    ``ENOSPC`` or ``EDQUOT``."""
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return True
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):  # rank -> (exception, its traceback) in torch's DCP
            for value in failures.values():
                todo += [v for v in (value if isinstance(value, tuple) else (value,))]
        todo += [e.__cause__, e.__context__]
    return False


def free_bytes(path: Path | str) -> int | None:
    """Bytes an unprivileged writer may still use on the file system holding ``path`` (its nearest
    existing folder), or None when that cannot be told."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        info = os.statvfs(where)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def disk_full(path: Path | str, exc: BaseException | None = None) -> bool:
    """Whether a write under ``path`` that failed with ``exc`` failed because the disk is full."""
    if no_space(exc):
        return True
    free = free_bytes(path)
    return free is not None and free < FULL_BELOW_BYTES


def full_disk_error(path: Path | str, what: str) -> OSError:
    """``[Errno 28] No space left on device (WHAT): 'PATH'``: the root cause a record keeps."""
    return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({what})", str(path))


RESERVE_BYTES = 1 << 20
"""Enough for a failure record and the record of a run of thousands of ranks, with their temp
files."""


def reserve_space(run_dir: Path | str) -> bool:
    """Write the reserve into ``run_dir``; whether it holds :data:`RESERVE_BYTES` now."""
    path = Path(run_dir) / files.RESERVE
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(RESERVE_BYTES))  # written, not sparse: the blocks are the file's
        return True
    except OSError:
        with contextlib.suppress(OSError):
            path.unlink()
        return False


def release_space(run_dir: Path | str) -> bool:
    """Remove the reserve; whether there was one to free."""
    try:
        (Path(run_dir) / files.RESERVE).unlink()
        return True
    except OSError:
        return False


def using_reserve(run_dir: Path | str, write: Callable[[], None]) -> None:
    """``write()``; on a full disk, free the reserve and ``write()`` again (once: the last words of
    a failing rank and of the launcher share it)."""
    try:
        write()
    except OSError as exc:
        if not (no_space(exc) and release_space(run_dir)):
            raise
        write()
