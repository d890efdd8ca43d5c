"""Loguru set-up for one rank: its log file always, the console when selected.

:data:`FILE_FORMAT` is the line format of every log in a run directory (the launcher's
``launcher.log`` too); the live view parses it back (:func:`wf_launch.observe.live.console_form`).
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path
from typing import IO, Any, TextIO

from loguru import logger

from ..rundir import files

__all__ = [
    "CLEAR_LINE",
    "CONSOLE_FORMAT",
    "FILE_FORMAT",
    "FILE_ONLY",
    "QUIET_MARK",
    "RankLogSink",
    "setup_rank_logging",
]

CONSOLE_FORMAT = (
    "<green>{time:HH:mm:ss.SSS}</green> <cyan>[{extra[label]}]</cyan> "
    "<level>{level: <7}</level> {message}"
)
FILE_FORMAT = (
    "{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <7} | [{extra[label]}] "
    "{name}:{function}:{line} | {message}"
)


QUIET_MARK = " (file only)"
"""After a record's ``where`` in a rank log: a record its console does not show (its failure), so
a launcher that streams the log (Ray, SLURM, ``status --follow``) does not show it either."""
_FILE_LINE = FILE_FORMAT + "\n{exception}"
_QUIET_LINE = FILE_FORMAT.replace("{line} |", "{line}" + QUIET_MARK + " |") + "\n{exception}"


def _file_format(record: Any) -> str:
    return _QUIET_LINE if record["extra"].get(FILE_ONLY) else _FILE_LINE


class RankLogSink:
    """A loguru sink that appends to a rank's log and never raises into the task.

    A write that fails (a full disk, a closed file) is dropped and counted; the
    first drop is noted once on the process's real stderr. With ``max_bytes`` the
    log keeps its head (the first half) and a rotating tail: past the head, lines
    go to ``rankN.tail.log``, which is moved to ``rankN.tail.log.1`` whenever it
    fills its half, so a rank that floods its log uses at most about 1.5 x
    ``max_bytes`` of disk.
    """

    def __init__(self, path: Path, max_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes if max_bytes and max_bytes > 0 else None
        self.dropped = 0
        self._file: Any = open(self.path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115
        self._size = self.path.stat().st_size
        self._tail: Any = None

    @property
    def tail_path(self) -> Path:
        return files.rank_tail_log(self.path)

    def _open_tail(self) -> IO[str]:
        """The newest lines' file, emptied; closed and rotated by :meth:`write`."""
        return open(self.tail_path, "w", encoding="utf-8", errors="replace")

    def write(self, message: str) -> None:
        try:
            if self.max_bytes is None:
                self._file.write(message)
                self._file.flush()
                return
            size = len(message.encode("utf-8", "replace"))
            half = self.max_bytes // 2
            if self._tail is None and self._size + size <= half:
                self._file.write(message)
                self._file.flush()
                self._size += size
                return
            if self._tail is None:
                self._file.write(
                    f"... log capped at {half} bytes (launcher.max_log_mb); the newest lines are "
                    f"in {self.tail_path} and {self.tail_path}.1\n"
                )
                self._file.flush()
                self._tail = self._open_tail()
                self._size = 0
            if self._size + size > half and self._size:
                self._tail.close()
                self.tail_path.replace(self.tail_path.with_name(self.tail_path.name + ".1"))
                self._tail = self._open_tail()
                self._size = 0
            self._tail.write(message)
            self._tail.flush()
            self._size += size
        except (OSError, ValueError) as exc:
            self.dropped += 1
            if self.dropped == 1:
                try:
                    sys.__stderr__.write(
                        f"wf_launch: cannot write {self.path} ({type(exc).__name__}: {exc}); "
                        "dropping log lines from now on\n"
                    )
                    sys.__stderr__.flush()
                except (OSError, ValueError, AttributeError):
                    pass


def _console_sink(message: str) -> None:
    """A rank's line on the launcher's terminal. On a terminal it first clears the line the cursor
    is on (the launcher's progress bar, redrawn under it at the launcher's next tick), so a log line
    never sticks to the bar."""
    try:
        stream = sys.__stderr__
        stream.write(f"{CLEAR_LINE}{message}" if _on_terminal(stream) else message)
        stream.flush()
    except (OSError, ValueError, AttributeError):
        pass


CLEAR_LINE = "\r\x1b[K"
"""Carriage return, then erase to the end of the line: what a line written under a progress bar
starts with."""
FILE_ONLY = "file_only"
"""``log.bind(file_only=True)``: a record for the rank's log file, never the console (its failure,
which the
launcher summarizes once for all ranks that failed alike)."""


def _on_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (OSError, ValueError, AttributeError):
        return False


def _for_console(record: Any) -> bool:
    return not record["extra"].get(FILE_ONLY)


class _LogStream(io.TextIOBase):
    """A text stream that turns each written line into a log record (for print()).

    Linear in what is written, whatever mix of ``\n`` and ``\r``: each write
    scans only its own text. A ``\r`` starts the line over (a progress bar's
    update), so only the last state of such a line is kept, and while a line is
    being redrawn its latest state is logged at most once per ``refresh_s``. A
    line that never ends is flushed in pieces of ``max_pending`` characters.
    """

    def __init__(
        self, name: str, fallback: TextIO, refresh_s: float = 1.0, max_pending: int = 1 << 16
    ) -> None:
        self._name = name
        self._parts: list[str] = []
        self._pending = 0
        self._fallback = fallback
        self._refresh_s = refresh_s
        self._max_pending = max_pending
        self._last_redraw = 0.0

    def writable(self) -> bool:
        return True

    def _emit(self, line: str, depth: int) -> None:
        logger.opt(depth=depth + 1).bind(stream=self._name).info(line)

    def _take(self) -> str:
        line = "".join(self._parts)
        self._parts, self._pending = [], 0
        return line

    def _add(self, segment: str) -> None:
        """Add text without a newline to the pending line, honouring ``\r``."""
        if "\r" in segment:
            head, _, after = segment.rpartition("\r")
            redrawn = head.rpartition("\r")[2] if "\r" in head else self._take() + head
            now = time.monotonic()
            if redrawn.strip() and now - self._last_redraw >= self._refresh_s:
                self._last_redraw = now
                self._emit(redrawn, 3)
            self._parts, self._pending = [after], len(after)
        else:
            self._parts.append(segment)
            self._pending += len(segment)
        if self._pending > self._max_pending:
            self._emit(self._take(), 3)

    def write(self, text: str) -> int:
        lines = text.split("\n")
        for line in lines[:-1]:
            self._add(line)
            self._emit(self._take(), 2)
        self._add(lines[-1])
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._emit(self._take(), 2)

    def fileno(self) -> int:
        return self._fallback.fileno()

    def isatty(self) -> bool:
        return False


def setup_rank_logging(
    log_file: Path,
    rank: int,
    label: str,
    console: bool,
    capture_prints: bool = True,
    max_log_mb: float = 0,
) -> Any:
    """Route this rank's loguru records to ``log_file`` (and stderr if ``console``).

    ``print()`` and warnings become records too (``capture_prints``), so every
    line a rank writes from Python lands in its file with the rank's label.
    Returns the bound logger tasks receive. Writing a log line never raises into
    the task (:class:`RankLogSink`); ``max_log_mb`` > 0 caps the file (head and tail).
    """
    log_file.parent.mkdir(parents=True, exist_ok=True)
    logger.remove()
    logger.configure(extra={"label": label, "rank": rank})
    max_bytes = int(max_log_mb * (1 << 20)) if max_log_mb and max_log_mb > 0 else None
    logger.add(
        RankLogSink(log_file, max_bytes),
        format=_file_format,
        level="DEBUG",
        enqueue=False,
        colorize=False,
        backtrace=False,
        diagnose=False,
        catch=False,
    )
    if console:
        colorize = bool(getattr(sys.__stderr__, "isatty", lambda: False)())
        logger.add(
            _console_sink,
            format=CONSOLE_FORMAT,
            level="INFO",
            colorize=colorize,
            backtrace=False,
            diagnose=False,
            catch=False,
            filter=_for_console,
        )
    if capture_prints:
        sys.stdout = _LogStream("stdout", sys.__stdout__)
        sys.stderr = _LogStream("stderr", sys.__stderr__)
    return logger.bind(rank=rank)
