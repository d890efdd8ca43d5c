"""The launcher's own console and ``launcher.log``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from loguru import logger

from ..rank.ranklog import FILE_FORMAT

__all__ = ["setup_launcher_logging"]


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
