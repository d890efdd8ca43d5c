"""How the reading tools (``checkpoint``, ``runs``, ``status``, ``plot``) end when their reader
goes away: quietly, as ``cat`` does, not with a ``BrokenPipeError`` traceback.

``python -m wf_launch.checkpoint list --json RUN | head -1`` closes the pipe after one line.
Python ignores SIGPIPE and raises on the next write instead; these tools only read a run, so
they restore the default action and die of the signal, like any Unix filter.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

__all__ = ["run_tool"]


def run_tool(main: Callable[[], int]) -> int:
    """``main()``'s exit status, with a closed stdout ending the process quietly (SIGPIPE)."""
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    return main()
