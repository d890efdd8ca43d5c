"""What runs on the cluster's nodes: the rank actor, and the small tasks that reach ranks.

The launcher asks each :class:`WfRayRank` :meth:`~WfRayRank.where` it is, then calls
:meth:`~WfRayRank.run`, which enters the same ``rank_main(RankSpec)`` as every launcher, in
the actor's main thread (where the rank installs its signal handlers). Preemption: SIGTERM sets
the stop flag; while ``launcher.max_restarts`` allows, the ranks leave :class:`Preempted` and
the launcher starts the next attempt, which resumes from the newest checkpoint.

A rank actor's main thread runs the rank, so the launcher never calls into it: ranks on this
host are signalled directly, the others through one small task per node (no CPU) that signals
their pids there (stack dumps, SIGTERM, the drill's SIGKILL). The drill's ``nodekill`` is such
a task too.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worldfoundry.core.distributed.env import LAUNCH_PORTS

from ...rank.entrypoint import Preempted, RankSpec, rank_main
from ...rank.ft import FT_HOST_ENV, FT_REPLICA_ENV
from ...rank.stackdump import DUMP_SIGNAL
from ...rundir import files
from ...rundir.pids import live_rank_pid
from . import ray_adapter as rt
from . import state


@dataclass(frozen=True)
class RayPreempt:
    """The preemption policy under Ray (see :class:`wf_launch.rank.preempt.PreemptHandler`)."""

    signal: str = "TERM"
    wait_s: float = 20.0
    attempt: int = 0
    max_restarts: int = 0

    def restart(self) -> int:
        return self.attempt

    def allowed(self) -> bool:
        return self.attempt < self.max_restarts

    def requeue(self) -> None:
        """Nothing to ask: the launcher starts the next attempt when its ranks leave preempted."""


@dataclass(frozen=True)
class RayStackDump:
    """``RankSpec.on_timeout`` under Ray: every rank dumps its stacks, on whichever node it is;
    then ``settle_s`` for the dumps to land."""

    run_dir: str
    settle_s: float = 1.5

    def __call__(self) -> None:
        where = state.where_of(self.run_dir)
        signal_ranks(Path(self.run_dir), where, int(DUMP_SIGNAL), timeout_s=10.0)
        time.sleep(self.settle_s)


class RunDirNotShared(RuntimeError):
    """This rank's node does not see the run directory (it is not on storage every node sees)."""


def _free_port(ip: str) -> int:
    """A port that was free on ``ip`` a moment ago, in :data:`LAUNCH_PORTS` (a port the kernel
    handed out is free only until rank 0 binds it, which can be a minute later on a loaded node:
    CI saw "cannot listen on 127.0.0.1:44909: Address already in use")."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(*LAUNCH_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((ip, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every try taken: any port
        s.bind((ip, 0))
        return int(s.getsockname()[1])


class WfRayRank:
    """One rank of a run (made a Ray actor with ``ray.remote`` by the launcher)."""

    def where(self, run_dir: str, want_port: bool) -> dict[str, Any]:
        """Where this rank runs, and (rank 0) a free port on its node for ``MASTER_PORT``. Nothing
        heavy is imported: torch imported here while the rank imports it could break both."""
        ip = rt.node_ip()
        info: dict[str, Any] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node": rt.current_node_id(),
            "ip": ip,
            "gpus": rt.gpu_ids(),
            "sees_run_dir": files.config_path(run_dir).is_file(),
        }
        if want_port:
            try:
                info["port"] = _free_port(ip)
            except OSError:
                info["port"] = _free_port("")
        return info

    def run(self, spec: RankSpec, env: dict[str, str], path: list[str]) -> dict[str, Any]:
        """Set the rank's environment (``path``: the launching shell's ``PYTHONPATH``, first on
        sys.path) and run it; ``{'preempted': bool}``."""
        if not files.config_path(spec.run_dir).is_file():
            raise RunDirNotShared(
                f"{spec.run_dir} is not visible on this node (no {files.CONFIG} there)"
            )
        os.environ.update(env)
        if FT_REPLICA_ENV in env:  # torchft's servers: on this node's address in the cluster
            os.environ[FT_HOST_ENV] = rt.node_ip()
        sys.path[:0] = [p for p in path if p not in sys.path]
        try:
            rank_main(spec)
        except Preempted:
            return {"preempted": True}
        except (SystemExit, KeyboardInterrupt) as exc:
            # Recorded by rank_main; an error so Ray reports it instead of ending the worker.
            raise RuntimeError(
                f"rank {env.get('RANK')} left with {type(exc).__name__}({exc})"
            ) from None
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # done: the launcher's kill ends it
        return {"preempted": False}


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
    Ranks on this host directly (a task needs a new worker, late on a loaded host); nodes that do
    not answer within ``timeout_s`` are left out."""
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
