"""Inside a rank: the Ray actor every rank is, its preemption policy and its hang hook.

Each rank is one :class:`WfRayRank` actor in the run's placement group. The launcher first
asks every actor :meth:`~WfRayRank.where` it is (node, host, address, pid, granted GPUs; rank 0
also a free port on its node for ``MASTER_PORT``; whether it sees the run directory), then
calls :meth:`~WfRayRank.run`, which sets the rank's environment and enters the same
``rank_main(RankSpec)`` as every other launcher. The method runs in the actor's main thread,
where the rank installs its signal handlers (stop flag, preemption, stack dumps).

Preemption (:class:`RayPreempt`): SIGTERM to a rank (a node draining) sets the stop flag of a
task that polls ``ctx.should_stop()``; the task saves and returns, and while
``launcher.max_restarts`` allows every rank leaves :class:`Preempted` and the launcher starts
the next attempt, which resumes from the newest checkpoint. A task that does not poll gets its
``on_preempt`` hook run.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...rank.entrypoint import Preempted, RankSpec, rank_main
from ...rank.stackdump import DUMP_SIGNAL
from ...rundir import files
from . import ray_adapter as rt
from . import state
from .reach import signal_ranks

__all__ = ["RayPreempt", "RayStackDump", "RunDirNotShared", "WfRayRank"]


@dataclass(frozen=True)
class RayPreempt:
    """The entrypoint's preemption policy under Ray (see
    :class:`wf_launch.rank.preempt.PreemptHandler`)."""

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
    """``RankSpec.on_timeout`` under Ray: every rank of the run dumps its stacks, on whichever node
    it is.

    Where the ranks are (node, pid) is read from the run's ``ray_run.json`` when it is needed; the
    rank that timed out sends the dump signal through one small task per node, then waits
    ``settle_s`` so the dumps land before it leaves.
    """

    run_dir: str
    settle_s: float = 1.5

    def __call__(self) -> None:
        where = state.where_of(self.run_dir)
        signal_ranks(Path(self.run_dir), where, int(DUMP_SIGNAL), timeout_s=10.0)
        time.sleep(self.settle_s)


class RunDirNotShared(RuntimeError):
    """This rank's node does not see the run directory (it is not on storage every node sees)."""


def _free_port(ip: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip if ip else "", 0))
        return int(s.getsockname()[1])


class WfRayRank:
    """One rank of a run (made a Ray actor with ``ray.remote`` by the launcher)."""

    def where(self, run_dir: str, want_port: bool) -> dict[str, Any]:
        """Where this rank runs, and (rank 0) a free port on its node for ``MASTER_PORT``.

        Nothing heavy is imported here: importing torch in a second thread while the rank imports it
        can hand the rank a half-initialised module (Python breaks the import-lock cycle that way).
        """
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
        """Set the rank's environment and run it; ``{'preempted': bool}`` (the task's value is in
        result.json).

        ``path``: entries of the launching shell's ``PYTHONPATH`` (user task modules), put first on
        sys.path.
        """
        if not files.config_path(spec.run_dir).is_file():
            raise RunDirNotShared(
                f"{spec.run_dir} is not visible on this node (no {files.CONFIG} there)"
            )
        os.environ.update(env)
        sys.path[:0] = [p for p in path if p not in sys.path]
        try:
            rank_main(spec)
        except Preempted:
            return {"preempted": True}
        except (SystemExit, KeyboardInterrupt) as exc:
            # Recorded by rank_main; raised on as an error so Ray reports it instead of ending the
            # worker.
            raise RuntimeError(
                f"rank {env.get('RANK')} left with {type(exc).__name__}({exc})"
            ) from None
        finally:
            signal.signal(
                signal.SIGTERM, signal.SIG_DFL
            )  # the rank is done: the launcher's kill ends it quietly
        return {"preempted": False}
