"""A rank in a fresh interpreter: ``task.fresh_interpreter=true`` runs the rank in a new Python
process.

A forked rank starts as a copy of the launcher's interpreter (torch imported, the
launcher's modules, signal dispositions, ``multiprocessing`` state). Most scripts never
notice; one that does (it sets environment variables torch reads at import, calls
``multiprocessing.set_start_method``, or must import in a clean process) asks for a
fresh interpreter. The rank process then becomes a thin supervisor of one child,
``python -m wf_launch.rank.fresh_entry SPEC PARENT_PID``, which runs the same
entrypoint with the same :class:`~.entrypoint.RankSpec` (pickled to a temporary file
that the child reads and deletes) and imports nothing of torch before the script does.

The supervisor forwards the signals a launcher or scheduler sends a rank (TERM, INT
unless ignored, HUP, USR1, USR2, and the stack-dump signal) to the child, and leaves as
the child did: the same exit code, or killed by the same signal, so the launcher's
root cause, restarts and autopsy see the rank as if it had run in place. The child
dies with its supervisor (``PR_SET_PDEATHSIG``) and publishes its own pid for stack
dumps and progress.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from worldfoundry.core.distributed.env import launch_attempt

from ..rundir import exits
from .hardexit import flush_and_exit

__all__ = ["FORWARDED", "FRESH_ENTRY", "in_fresh_interpreter", "mark_fresh", "run_fresh_if_asked"]

FRESH_ENTRY = "wf_launch.rank.fresh_entry"
"""The module the fresh interpreter runs (``python -m``)."""

FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGURG,
)
"""Signals the supervisor passes on to the fresh interpreter."""

_state = {"fresh": False}


def in_fresh_interpreter() -> bool:
    """Whether this process is the fresh interpreter of a rank."""
    return _state["fresh"]


def mark_fresh() -> None:
    """Called by :mod:`.fresh_entry`: this process already is the fresh interpreter."""
    _state["fresh"] = True


def run_fresh_if_asked(spec: Any) -> dict[str, Any] | None:
    """None when the rank's task does not ask for a fresh interpreter; else run the rank in one.

    Returns the rank's result when the child succeeded; otherwise this process leaves
    with the child's exit code (or dies of its signal) and never returns.
    """
    task = spec.config.get("task") or {}
    if task.get("fresh_interpreter") is not True or in_fresh_interpreter():
        return None
    fd, path = tempfile.mkstemp(prefix="wf_rank_spec_", suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
        pickle.dump(spec, f)
    child: list[subprocess.Popen[bytes]] = []
    pending: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        if child:
            child[0].send_signal(signum)
        else:
            pending.append(signum)

    for signum in FORWARDED:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, forward)
    try:
        child.append(subprocess.Popen([sys.executable, "-m", FRESH_ENTRY, path, str(os.getpid())]))
    except BaseException:
        os.unlink(path)
        raise
    for signum in pending:
        child[0].send_signal(signum)
    return _leave_as(child[0].wait(), spec)


def _leave_as(code: int, spec: Any) -> dict[str, Any]:
    """Mirror the child's end: its result (exit code 0), its exit code, or its signal."""
    if code == 0:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        rank = int(os.environ.get("RANK", "0") or 0)
        record = exits.read_exits(spec.run_dir, world, launch_attempt()).get(rank) or {}
        return record.get("result") or {}
    if code < 0:
        try:
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL / SIGSTOP: no handler to reset
        os.kill(os.getpid(), -code)
        time.sleep(
            5
        )  # a signal that does not end the process (it was caught elsewhere): leave anyway
        flush_and_exit(128 - code)
    flush_and_exit(code)
    return {}
