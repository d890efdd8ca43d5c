"""Loguru set-up for one rank: its log file always, the console when selected."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any, TextIO

from loguru import logger

from worldfoundry.core.distributed.topology import DIMS

__all__ = ["CONSOLE_FORMAT", "FILE_FORMAT", "rank_label", "setup_launcher_logging", "setup_rank_logging"]

CONSOLE_FORMAT = ("<green>{time:HH:mm:ss.SSS}</green> <cyan>[{extra[label]}]</cyan> "
                  "<level>{level: <7}</level> {message}")
FILE_FORMAT = ("{time:YYYY-MM-DD HH:mm:ss.SSS} | {level: <7} | [{extra[label]}] "
               "{name}:{function}:{line} | {message}")


def rank_label(rank: int, coords: dict[str, int]) -> str:
    """'r5 tp0 cp1 pp1 dp0': a rank and its layout coordinates."""
    return f"r{rank} " + " ".join(f"{d}{coords[d]}" for d in DIMS)


class _LogStream(io.TextIOBase):
    """A text stream that turns each written line into a log record (for print())."""

    def __init__(self, name: str, fallback: TextIO) -> None:
        self._name = name
        self._buf = ""
        self._fallback = fallback

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._buf += text
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            logger.opt(depth=1).bind(stream=self._name).info(line)
        return len(text)

    def flush(self) -> None:
        if self._buf:
            logger.opt(depth=1).bind(stream=self._name).info(self._buf)
            self._buf = ""

    def fileno(self) -> int:
        return self._fallback.fileno()

    def isatty(self) -> bool:
        return False


def setup_rank_logging(log_file: Path, rank: int, label: str, console: bool,
                       capture_prints: bool = True) -> Any:
    """Route this rank's loguru records to ``log_file`` (and stderr if ``console``).

    ``print()`` and warnings become records too (``capture_prints``), so every
    line a rank writes from Python lands in its file with the rank's label.
    Returns the bound logger tasks receive.
    """
    log_file.parent.mkdir(parents=True, exist_ok=True)
    logger.remove()
    logger.configure(extra={"label": label, "rank": rank})
    logger.add(str(log_file), format=FILE_FORMAT, level="DEBUG", enqueue=False, buffering=1,
               backtrace=False, diagnose=False)
    if console:
        logger.add(sys.__stderr__, format=CONSOLE_FORMAT, level="INFO", colorize=None,
                   backtrace=False, diagnose=False)
    if capture_prints:
        sys.stdout = _LogStream("stdout", sys.__stdout__)
        sys.stderr = _LogStream("stderr", sys.__stderr__)
    return logger.bind(rank=rank)


def setup_launcher_logging(log_file: Path | None) -> Any:
    """Launcher-side loguru: the console, plus ``launcher.log`` in the run directory."""
    logger.remove()
    logger.configure(extra={"label": "launcher", "rank": -1})
    logger.add(sys.stderr, format=("<green>{time:HH:mm:ss.SSS}</green> <magenta>[wf_launch]</magenta> "
                                   "<level>{level: <7}</level> {message}"), level="INFO")
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        logger.add(str(log_file), format=FILE_FORMAT, level="DEBUG", buffering=1)
    return logger
