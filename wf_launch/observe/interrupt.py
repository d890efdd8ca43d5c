"""Ctrl-C in the launcher while it starts: one line and exit 130, never a traceback.

Python turns SIGINT into :class:`KeyboardInterrupt` wherever the main thread is; while a
library is being imported (torch pulls in sympy) that can leave a module half-initialised,
and the traceback the user then sees is the next import's ``AttributeError``, not the
Ctrl-C. :func:`catch_sigint` notes every Ctrl-C before raising, so the CLI can tell an
error that a Ctrl-C caused (:func:`interrupted`) from a real one, and answer both the same way.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = [
    "EXIT_INTERRUPTED",
    "NOTHING_LAUNCHED",
    "catch_sigint",
    "deferred",
    "exit_interrupted",
    "interrupted",
    "raise_if_interrupted",
    "undefer",
]

EXIT_INTERRUPTED = 128 + signal.SIGINT
NOTHING_LAUNCHED = "wf_launch: interrupted (Ctrl-C) before the run started; nothing was launched"
_SEEN = [False]
_DEFERRED = [False]


def _note_and_raise(signum: int, frame: FrameType | None) -> None:
    _SEEN[0] = True
    if not _DEFERRED[0]:
        raise KeyboardInterrupt


@contextmanager
def deferred() -> Iterator[None]:
    """Hold a Ctrl-C (noted, not raised) until :func:`undefer` or the end of the block.

    Hydra makes the run directory before the app can note it, and on an interrupt it forgets the
    directory it made: a Ctrl-C in between would leave an empty run directory and no record.
    """
    _DEFERRED[0] = True
    try:
        yield
    finally:
        undefer()


def undefer() -> None:
    """Let Ctrl-C raise again, raising at once the one held since :func:`deferred`."""
    if _DEFERRED[0]:
        _DEFERRED[0] = False
        if _SEEN[0]:
            raise KeyboardInterrupt


def catch_sigint() -> None:
    """From now on a Ctrl-C is noted (:func:`interrupted`) and raises :class:`KeyboardInterrupt`."""
    signal.signal(signal.SIGINT, _note_and_raise)


def interrupted() -> bool:
    """Whether a Ctrl-C reached this process since :func:`catch_sigint`."""
    return _SEEN[0]


def raise_if_interrupted() -> None:
    """Raise the :class:`KeyboardInterrupt` of a Ctrl-C noted since :func:`catch_sigint` (and
    not held by :func:`deferred`) that never surfaced: a library's bare ``except:`` swallowed
    it (an import it cut short). Called before anything starts that a Ctrl-C must stop."""
    if _SEEN[0] and not _DEFERRED[0]:
        raise KeyboardInterrupt


def exit_interrupted() -> None:
    """Leave at once with exit 130 and the one line saying nothing was launched."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C cannot cut the line short
    sys.stderr.write(NOTHING_LAUNCHED + "\n")
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)
