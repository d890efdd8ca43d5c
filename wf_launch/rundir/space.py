"""A full disk, told apart from other write failures, so a run's record can name it.

torch's checkpoint writer reports a full disk as ``unexpected pos 704 vs 598`` (its zip
writer's view of a short write), not as ``ENOSPC``: :func:`disk_full` looks for the errno
anywhere in an exception's chain and, failing that, at the free space of the file system.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["FULL_BELOW_BYTES", "disk_full", "free_bytes", "full_disk_error", "no_space"]

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
