"""Inside a rank: the Ray actor every rank is, its preemption policy and its hang hook.

The launcher asks each :class:`WfRayRank` :meth:`~WfRayRank.where` it is, then calls
:meth:`~WfRayRank.run`, which enters the same ``rank_main(RankSpec)`` as every launcher, in
the actor's main thread (where the rank installs its signal handlers). Preemption: SIGTERM sets
the stop flag; while ``launcher.max_restarts`` allows, the ranks leave :class:`Preempted` and
the launcher starts the next attempt, which resumes from the newest checkpoint.
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
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


class WfRayRank:
    """One rank of a run (made a Ray actor with ``ray.remote`` by the launcher)."""

    def where(self, run_dir: str, want_port: bool) -> dict[str, Any]:
        """Where this rank runs, and (rank 0) a free port on its node for ``MASTER_PORT``.

        Nothing heavy is imported here: torch imported in a second thread while the rank imports
        it can hand the rank a half-initialised module.
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
        """Set the rank's environment (``path``: the launching shell's ``PYTHONPATH``, first on
        sys.path) and run it; ``{'preempted': bool}``."""
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
            # Recorded by rank_main; an error so Ray reports it instead of ending the worker.
            raise RuntimeError(
                f"rank {env.get('RANK')} left with {type(exc).__name__}({exc})"
            ) from None
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # done: the launcher's kill ends it
        return {"preempted": False}
