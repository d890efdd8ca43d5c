"""Atomic writes and bounded reads: the one reader of every file of a run, sweep, tune or drill.

Reading is as careful as writing: a run directory may hold files someone else
(or a crash) left, so :func:`read_bytes` reads regular files only (a FIFO, a device
or ``/dev/zero`` behind a link would block or never end), and refuses a file over
its size limit instead of loading it; :func:`read_json` adds the JSON parse, with
a nesting too deep for the parser reported like any other bad JSON; :func:`read_yaml` the
YAML parse without aliases (a 547-byte alias bomb expands to gigabytes); :func:`read_text`
and :func:`read_lines` text, whole or streamed. No other module of the project reads a
file of those directories (``tests/test_safe_readers.py`` scans for one).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import yaml

__all__ = [
    "MAX_RECORD_BYTES",
    "OutputRefused",
    "UnreadableFile",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "check_output_path",
    "never_follow",
    "open_log",
    "open_regular",
    "read_bytes",
    "read_json",
    "read_lines",
    "read_text",
    "read_yaml",
    "write_output_file",
]

MAX_RECORD_BYTES = 64 << 20
"""The largest JSON or YAML record of a run that is read (64 MiB): a bigger one is refused, not
loaded."""


class UnreadableFile(ValueError):
    """A run file that exists but cannot be read as what it should be (its path and why)."""

    def __init__(self, path: Path | str, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = Path(path)
        self.why = why


MAX_TEXT_BYTES = 1 << 20
"""The largest small text file of a run read whole (``run_id``, a lock, a plan): 1 MiB."""


def atomic_write_text(path: Path | str, text: str) -> None:
    """Write ``text`` to ``path`` so readers see the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a new temp file renamed over it: a link at ``path`` is
    replaced, never written through, and a link in place of one of the run's own folders
    (``logs/``) is refused (``OSError`` ``ELOOP``)."""
    path = Path(path)
    folder = _open_folder(path)
    try:
        where = {} if folder is None else {"dir_fd": folder}
        base = path if folder is None else Path(path.name)
        tmp = base.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, **where)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, base, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, **where)
            raise
    finally:
        if folder is not None:
            os.close(folder)


def atomic_write_json(path: Path | str, data: Any) -> None:
    """JSON-encode ``data`` (indent 2, keys in order given) and write it atomically."""
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


_OWN_FOLDER: list[Callable[[str], bool]] = [lambda name: False]
"""Whether a folder name is one a run, sweep, tune or drill makes inside itself (``logs``,
``checkpoints``, ``step_N``...): :mod:`.files`, which names them, sets it at import."""


def never_follow(is_own_folder: Callable[[str], bool]) -> None:
    """Set which folder names are a tool directory's own: a link in their place is never
    followed, for a read or a write (:mod:`.files` calls this once)."""
    _OWN_FOLDER[0] = is_own_folder


class _LinkedFolder(OSError):
    """A folder of a run's own (``logs/``) that is a symbolic link."""


def _open_folder(path: Path) -> int | None:
    """An fd on ``path``'s folder, reached without following a link in place of one of the run's
    own folders (``RUN/logs`` -> ``/etc``), or None when the path has none of them.

    The folder above them (the run directory, wherever the user put it) is opened as it is
    (it may be a link the user made); each own folder below it is opened relative to its
    parent with ``O_NOFOLLOW``, so a link swapped in meanwhile is refused as well.
    """
    own: list[str] = []
    folder = path.parent
    while folder.name and _OWN_FOLDER[0](folder.name):
        own.append(folder.name)
        folder = folder.parent
    if not own:
        return None
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for name in reversed(own):
        try:
            inner = os.open(
                name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
            )
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(folder / name):
                why = f"its folder {folder / name} is a symbolic link (refusing to follow it)"
                raise _LinkedFolder(errno.ELOOP, why, str(path)) from None
            raise
        finally:
            os.close(fd)
        fd, folder = inner, folder / name
    return fd


def _open_in_folder(path: Path, flags: int, mode: int = 0o777) -> int:
    """``os.open(path, flags | O_NOFOLLOW)``, its folders checked by :func:`_open_folder`."""
    folder = _open_folder(path)
    if folder is None:
        return os.open(path, flags | os.O_NOFOLLOW, mode)
    try:
        return os.open(path.name, flags | os.O_NOFOLLOW, mode, dir_fd=folder)
    finally:
        os.close(folder)


def open_log(path: Path | str) -> int:
    """An fd appending to the log ``path``: owner-only (``0600``, whatever the umask or an older
    mode), never through a link, for a child's output (a tune round's, a drill run's)."""
    fd = _open_in_folder(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
    except OSError:
        os.close(fd)
        raise
    return fd


def open_regular(path: Path | str) -> int:
    """An fd open for reading on ``path`` if it is a regular file (FileNotFoundError when absent).

    Opened without blocking (a FIFO would wait for a writer) and without following a link
    (one could lead out of the run directory: ``logs/rank0.log`` -> ``/etc/shadow``), then
    checked: anything but a regular file raises :class:`UnreadableFile`, as does an open
    that fails for another reason.
    """
    try:
        fd = _open_in_folder(Path(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except _LinkedFolder as exc:
        raise UnreadableFile(path, exc.strerror) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            why = "a symbolic link, not a regular file (refusing to follow it)"
            raise UnreadableFile(path, why) from None
        raise UnreadableFile(path, exc.strerror or str(exc)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise UnreadableFile(path, f"{kind} (refusing to read it)")
    os.set_blocking(fd, True)
    return fd


def read_bytes(path: Path | str, limit: int = MAX_RECORD_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them (:class:`UnreadableFile`
    otherwise)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UnreadableFile(
                path, f"{size} bytes, more than the {limit} a record may have (not loaded)"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise UnreadableFile(path, exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UnreadableFile(path, f"more than the {limit} bytes a record may have (not loaded)")
    return data


def read_json(path: Path | str, limit: int = MAX_RECORD_BYTES) -> Any:
    """Parsed JSON at ``path``, or None if it does not exist; :class:`UnreadableFile` (a ValueError)
    if it cannot be read or parsed."""
    try:
        data = read_bytes(path, limit)
    except FileNotFoundError:
        return None
    try:
        return json.loads(data)
    except RecursionError:
        raise UnreadableFile(path, "JSON nested too deeply") from None
    except ValueError as exc:
        raise UnreadableFile(path, f"invalid JSON ({exc}); the file may be truncated") from None


def read_text(path: Path | str, limit: int = MAX_TEXT_BYTES) -> str:
    """The text of the regular file ``path`` (UTF-8, bad bytes replaced), at most ``limit``
    bytes."""
    return read_bytes(path, limit).decode("utf-8", errors="replace")


def read_lines(path: Path | str) -> Iterator[str]:
    """The lines of the regular file ``path`` (UTF-8, bad bytes replaced), streamed: a file
    of any length costs one line of memory at a time (a line is cut at 1 MiB)."""
    fd = open_regular(path)
    with open(fd, "rb") as f:
        while line := f.readline(MAX_TEXT_BYTES):
            yield line.decode("utf-8", errors="replace")


class _NoAliasLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses anchors and aliases: a run's YAML never needs them."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            line = self.peek_event().start_mark.line + 1
            raise yaml.YAMLError(f"an alias at line {line} (aliases are refused)")
        return super().compose_node(parent, index)


def read_yaml(path: Path | str, limit: int = MAX_RECORD_BYTES) -> Any:
    """Parsed YAML at ``path`` (safe types, no aliases), or None if it does not exist;
    :class:`UnreadableFile` if it cannot be read or parsed."""
    try:
        data = read_bytes(path, limit)
    except FileNotFoundError:
        return None
    try:
        return yaml.load(data, Loader=_NoAliasLoader)
    except RecursionError:
        raise UnreadableFile(path, "YAML nested too deeply") from None
    except yaml.YAMLError as exc:
        raise UnreadableFile(path, f"invalid YAML ({' '.join(str(exc).split())})") from None


class OutputRefused(ValueError):
    """An output path a tool will not write (what it is, and what to do instead)."""


def check_output_path(out: Path, force: bool, option: str = "--out") -> None:
    """:class:`OutputRefused` unless ``out`` is free, or a regular file and ``force`` is set.

    A device, a FIFO, a directory or a link is never replaced (as root, replacing
    ``/dev/null`` would break the system), and an existing file only when asked.
    """
    try:
        info = os.lstat(out)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise OutputRefused(f"{option} {out}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(info.st_mode):
        raise OutputRefused(f"{option} {out}: a symbolic link (refusing to replace it)")
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise OutputRefused(f"{option} {out}: {kind} (refusing to replace it)")
    if not force:
        raise OutputRefused(f"{option} {out}: exists (--force replaces it)")


def write_output_file(
    out: Path, write: Callable[[IO[bytes]], None], force: bool, option: str = "--out"
) -> None:
    """Write ``out`` through ``write``: a new temp file beside it (``O_EXCL``, never a link),
    fsynced, then moved in place; an existing ``out`` only if regular and ``force``.

    Without ``force`` the temp file is hard-linked to ``out``, which fails if ``out``
    appeared meanwhile: a file is never replaced unless asked. :class:`OutputRefused`, one
    line, for every refusal and failure (the temp file removed).
    """
    out = Path(out)
    check_output_path(out, force, option)
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.part")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise OutputRefused(f"{option} {out}: cannot write there ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if force:
            check_output_path(out, force, option)
            os.replace(tmp, out)
        else:
            os.link(tmp, out)
    except FileExistsError:
        raise OutputRefused(f"{option} {out}: exists (--force replaces it)") from None
    except OSError as exc:
        raise OutputRefused(f"{option} {out}: cannot write it ({exc.strerror or exc})") from None
    finally:
        tmp.unlink(missing_ok=True)
