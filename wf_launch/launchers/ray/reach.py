"""Reaching ranks on any node of the cluster: a signal to their processes, or the end of a node's
raylet.

A rank actor's main thread runs the rank (signal handlers can only be installed there), so the
launcher never calls into it while it runs. To signal ranks it starts one tiny task on each node
that holds some of them (``NodeAffinitySchedulingStrategy``, no CPU), which sends the signal to
their pids on that node: the stack-dump signal for the hang autopsy and ``status --stacks``,
SIGTERM for a stop, SIGKILL for the drill. The drill's ``nodekill`` is such a task too: it
kills its own node's raylet (whose processes then all end).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

from ...rundir.pids import live_rank_pid
from . import ray_adapter as rt

__all__ = ["kill_raylet", "signal_ranks"]

_REMOTE: dict[str, Any] = {}


def _signal_here(pids: list[int], signum: int) -> list[int]:
    """On a node: send ``signum`` to each of ``pids``; the pids reached."""
    sent = []
    for pid in pids:
        try:
            os.kill(pid, signum)
            sent.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    return sent


def _kill_raylet_pid(pid: int | None) -> int:
    """SIGKILL ``pid``, checked to be a raylet; its pid."""
    if pid is None:
        raise RuntimeError("this process was not started by a raylet")
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        if b"raylet" not in f.read():
            raise RuntimeError(f"pid {pid} is not a raylet")
    os.kill(pid, signal.SIGKILL)
    return pid


def _kill_own_raylet() -> int:
    """On a node: SIGKILL this node's raylet (checked to be one); its pid."""
    return _kill_raylet_pid(rt.raylet_pid())


def _raylet_of(run_dir: Path, rank: int) -> int | None:
    """The raylet of ``rank``'s node when the rank runs on this host (from its environment)."""
    pid = live_rank_pid(run_dir, rank)
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.partition(b"=")[::2] for item in f.read().split(b"\0"))
    except (OSError, TypeError):
        return None
    raw = env.get(rt.RAYLET_PID_ENV.encode(), b"")
    return int(raw) if raw.isdigit() else None


def _remote(fn: Any) -> Any:
    if fn.__name__ not in _REMOTE:
        _REMOTE[fn.__name__] = rt.remote(fn, num_cpus=0, max_retries=0)
    return _REMOTE[fn.__name__]


def _signal_on_this_host(run_dir: Path, where: dict[int, tuple[str, int]], signum: int) -> set[int]:
    """The ranks that run on this host (their pid file names their live process): signalled
    directly. A task on their node would need a new worker process first, which a loaded host
    starts only after the collective that timed out has ended the ranks."""
    reached = set()
    for rank, (_, pid) in where.items():
        if live_rank_pid(run_dir, rank) == int(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(pid), signum)
                reached.add(rank)
    return reached


def signal_ranks(
    run_dir: Path, where: dict[int, tuple[str, int]], signum: int, timeout_s: float = 15.0
) -> set[int]:
    """Send ``signum`` to each rank's process (``where``: rank -> (node id, pid)); the ranks
    reached.

    Ranks on this host directly, the others through one small task per node. Nodes that do not
    answer within ``timeout_s`` (dead, or too busy to start a task) are left out.
    """
    here = _signal_on_this_host(Path(run_dir), where, signum)
    by_node: dict[str, dict[int, int]] = {}
    for rank, (node, pid) in where.items():
        if rank not in here:
            by_node.setdefault(node, {})[int(pid)] = rank
    if not by_node:
        return here
    fn = _remote(_signal_here)
    refs = {
        fn.options(scheduling_strategy=rt.on_node(node)).remote(list(pids), int(signum)): pids
        for node, pids in by_node.items()
    }
    ready, _ = rt.wait_all(list(refs), timeout_s)
    reached = set(here)
    for ref in ready:
        try:
            reached |= {refs[ref][pid] for pid in rt.get(ref)}
        except Exception:
            continue
    return reached


def kill_raylet(run_dir: Path, rank: int, node: str, timeout_s: float = 30.0) -> int:
    """SIGKILL the raylet of ``node``, which runs ``rank`` (every rank on it ends with it); the
    raylet's pid. On this host directly; elsewhere through a task on that node."""
    here = _raylet_of(Path(run_dir), rank)
    if here is not None:
        return _kill_raylet_pid(here)
    task = _remote(_kill_own_raylet).options(scheduling_strategy=rt.on_node(node)).remote()
    try:
        return int(rt.get(task, timeout_s))
    except Exception as exc:
        if type(exc).__name__ == "NodeDiedError":  # the task went with its raylet: killed
            return 0
        raise
