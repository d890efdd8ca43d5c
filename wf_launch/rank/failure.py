"""What a failing rank records before it leaves: its exception, classified, in
``logs/rank{r}.error.json``."""

from __future__ import annotations

import os
import re
import socket
import time
import traceback
from pathlib import Path
from typing import Any

from worldfoundry.core.distributed.env import launch_attempt
from worldfoundry.core.validation import is_int

from ..rundir import files
from ..rundir.failures import is_peer_loss_message, write_failure_record

__all__ = [
    "current_attempt",
    "is_peer_loss",
    "is_timeout_error",
    "launcher_frame",
    "record_failure",
    "user_traceback",
]

_GLOO_TIMEOUT = re.compile(
    r"^\[[^\]]*gloo[^\]]*\] Timed out|^Application timeout caused pair closure"
)
_TIMEOUT_WORDS = re.compile(r"timed out|timeout|deadline exceeded", re.IGNORECASE)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return seen


def is_timeout_error(exc: BaseException) -> bool:
    """Whether ``exc`` is (or was caused by) a collective or store that gave up waiting.

    Recognised by type and origin, never by a word alone: torch's
    ``DistStoreError`` / ``DistBackendError`` with timeout wording (store waits,
    NCCL's watchdog), and gloo's own ``RuntimeError`` whose message comes from gloo's
    transport (``[.../gloo/...] Timed out waiting ...``). A user's
    ``ValueError("bad timeout")`` is not a timeout.
    """
    import torch.distributed as dist

    for e in _chain(exc):
        if isinstance(e, (dist.DistStoreError, dist.DistBackendError)) and _TIMEOUT_WORDS.search(
            str(e)
        ):
            return True
        if type(e) is RuntimeError and _GLOO_TIMEOUT.search(str(e)):
            return True
    return False


def is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` only says another rank went away (a consequence, not a cause)."""
    return is_peer_loss_message(str(exc))


def current_attempt() -> int:
    """Which try of the run this rank belongs to (``WF_ATTEMPT``, set by the launcher; 0 when
    unset)."""
    try:
        return launch_attempt()
    except ValueError:
        return 0


def record_failure(
    run_dir: Path | str, rank: int, coords: dict[str, int], exc: BaseException
) -> dict[str, Any]:
    """Write this rank's failure record (atomically) and return it."""
    kind = (
        "timeout"
        if is_timeout_error(exc)
        else ("interrupt" if isinstance(exc, KeyboardInterrupt) else "exception")
    )
    record = {
        "rank": rank,
        "coords": coords,
        "kind": kind,
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "time": time.time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "log": str(files.rank_log(run_dir, rank)),
        "attempt": current_attempt(),
    }
    user = user_traceback(exc)
    if user != record["traceback"]:
        record["user_traceback"] = user
    code = getattr(exc, "exit_code", None)
    if is_int(code):
        record["exit_code"] = code  # a script's sys.exit(n): the code the rank exits with
        record["exit_at"] = f"{getattr(exc, 'at', '?')} in {getattr(exc, 'function', '?')}"
    write_failure_record(run_dir, rank, record)
    return record


_PACKAGE = Path(__file__).resolve().parents[1]
_RUNNERS = ("runpy.py", "contextlib.py", "<frozen runpy>")
"""The standard library's frames between the launcher and a script (``python train.py``'s own)."""
_LAUNCHER_PARTS = (("rank",), ("launchers",), ("tasks", "script.py"), ("tasks", "call.py"))


def launcher_frame(filename: str) -> bool:
    """Whether a frame of ``filename`` is the launcher's own code around the user's."""
    if Path(filename).name in _RUNNERS:
        return True
    try:
        parts = Path(filename).resolve().relative_to(_PACKAGE).parts
    except (ValueError, OSError):
        return False
    return any(parts[: len(p)] == p for p in _LAUNCHER_PARTS)


def user_traceback(exc: BaseException) -> str:
    """``exc``'s traceback from the first frame of the user's code on (the launcher's frames
    above it stay in the rank log); the whole traceback when no frame is the user's."""
    tb = exc.__traceback__
    while tb is not None and launcher_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))
