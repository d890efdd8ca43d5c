"""The launcher's own console and ``launcher.log``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from loguru import logger

from ..rank.ranklog import CLEAR_LINE, FILE_FORMAT

__all__ = ["print_or_quiet", "setup_launcher_logging"]


def _on_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (OSError, ValueError, AttributeError):
        return False


def _console(message: str) -> None:
    """A launcher line on a terminal: it clears the line first (a progress bar, redrawn below it at
    the next tick), so that no line sticks to the bar."""
    sys.stderr.write(CLEAR_LINE + message)
    sys.stderr.flush()


def setup_launcher_logging(log_file: Path | None) -> Any:
    """Launcher-side loguru: the console, plus ``launcher.log`` in the run directory."""
    logger.remove()
    logger.configure(extra={"label": "launcher", "rank": -1})
    tty = _on_terminal()
    logger.add(
        _console if tty else sys.stderr,
        colorize=tty,
        level="INFO",
        format="<green>{time:HH:mm:ss.SSS}</green> <magenta>[wf_launch]</magenta> <level>{level: "
        "<7}</level> {message}",
    )
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        logger.add(_LogFile(log_file), format=FILE_FORMAT, level="DEBUG", colorize=False)
    return logger


class _LogFile:
    """``launcher.log``, appended line by line (never through a link); a line that cannot be
    written (a full disk) is dropped and noted once on the console, never raised: loguru would
    print a traceback for every line, and the launcher still has a run to record."""

    def __init__(self, path: Path) -> None:
        self.path = path
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self._file = os.fdopen(
            os.open(path, flags, 0o600), "a", buffering=1, encoding="utf-8", errors="replace"
        )
        self.failed = False

    def write(self, message: str) -> None:
        if self.failed:
            return
        try:
            self._file.write(message)
        except OSError as exc:
            self.failed = True
            sys.stderr.write(
                f"wf_launch: cannot write {self.path} ({exc}); dropping launcher log lines\n"
            )

    def stop(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass


def print_or_quiet(text: str) -> int:
    """Print ``text`` to stdout; 0, or 1 when the reader has gone (``... | head``) instead of
    a ``BrokenPipeError`` traceback (stdout then points at ``/dev/null``: the exit is quiet)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0
