"""Reaching ranks on any node: a signal to their processes, or the end of a node's raylet.

A rank actor's main thread runs the rank, so the launcher never calls into it. Ranks on this
host are signalled directly; the others through one small task per node that holds some of
them (no CPU), which signals their pids there. The drill's ``nodekill`` is such a task too.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

from ...rundir.pids import live_rank_pid
from . import ray_adapter as rt

_REMOTE: dict[str, Any] = {}


def _signal_here(pids: list[int], signum: int) -> list[int]:
    """On a node: send ``signum`` to each of ``pids``; the pids reached."""
    sent = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)
            sent.append(pid)
    return sent


def _kill_raylet(pid: int | None = None) -> int:
    """SIGKILL ``pid`` (by default this worker's raylet), checked to be a raylet; its pid."""
    pid = rt.raylet_pid() if pid is None else pid
    if pid is None:
        raise RuntimeError("this process was not started by a raylet")
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        if b"raylet" not in f.read():
            raise RuntimeError(f"pid {pid} is not a raylet")
    os.kill(pid, signal.SIGKILL)
    return pid


def _raylet_of(run_dir: Path, rank: int) -> int | None:
    """The raylet of ``rank``'s node when the rank runs on this host (from its environment)."""
    try:
        with open(f"/proc/{live_rank_pid(run_dir, rank)}/environ", "rb") as f:
            env = dict(item.partition(b"=")[::2] for item in f.read().split(b"\0"))
    except (OSError, TypeError):
        return None
    raw = env.get(rt.RAYLET_PID_ENV.encode(), b"")
    return int(raw) if raw.isdigit() else None


def _on_node(fn: Any, node: str) -> Any:
    if fn.__name__ not in _REMOTE:
        _REMOTE[fn.__name__] = rt.remote(fn, num_cpus=0, max_retries=0)
    return _REMOTE[fn.__name__].options(scheduling_strategy=rt.on_node(node))


def signal_ranks(
    run_dir: Path, where: dict[int, tuple[str, int]], signum: int, timeout_s: float = 15.0
) -> set[int]:
    """Send ``signum`` to each rank's process (``where``: rank -> (node id, pid)); those reached.

    A task on another node needs a new worker process first, which a loaded host starts late:
    ranks on this host are signalled directly. Nodes that do not answer within ``timeout_s``
    (dead, or too busy) are left out.
    """
    here = {
        r
        for r, (_, pid) in where.items()
        if live_rank_pid(run_dir, r) == int(pid) and _signal_here([int(pid)], signum)
    }
    reached = set(here)
    by_node: dict[str, dict[int, int]] = {}
    for rank, (node, pid) in where.items():
        if rank not in here:
            by_node.setdefault(node, {})[int(pid)] = rank
    refs = {
        _on_node(_signal_here, node).remote(list(pids), int(signum)): pids
        for node, pids in by_node.items()
    }
    for ref in rt.wait_all(list(refs), timeout_s)[0]:
        with contextlib.suppress(Exception):
            reached |= {refs[ref][pid] for pid in rt.get(ref)}
    return reached


def kill_raylet(run_dir: Path, rank: int, node: str, timeout_s: float = 30.0) -> int:
    """SIGKILL the raylet of ``node``, which runs ``rank``; its pid (0: gone with its task)."""
    here = _raylet_of(Path(run_dir), rank)
    if here is not None:
        return _kill_raylet(here)
    try:
        return int(rt.get(_on_node(_kill_raylet, node).remote(), timeout_s))
    except Exception as exc:
        if type(exc).__name__ == "NodeDiedError":  # the task went with its raylet: killed
            return 0
        raise
