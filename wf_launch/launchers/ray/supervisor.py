"""The run's supervisor: an actor that runs :class:`~.monitor.RayRun` inside the cluster.

For ``launcher.wait=false`` (*detached*: it outlives the command, ends itself once the run is
recorded; ``status --cancel`` finds it by name) and for a sweep's points (owned by the sweep's
command, side by side). It owns the run's placement group and rank actors: if it dies, they go
with it. Its log lines go to the run's ``launcher.log``.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import Any

from loguru import logger

from ...rank.ranklog import FILE_FORMAT
from ...rundir import files
from ...rundir.record import RunRecord, Status
from . import ray_adapter as rt
from .monitor import RayRun

NAMESPACE = "wf_launch"
"""The Ray namespace of every supervisor (they are found by name there)."""
_CLASS: dict[str, Any] = {}


def supervisor_name(run_dir: Path | str) -> str:
    """A name unique to this run (the run directory and the time it started)."""
    key = f"{Path(run_dir).absolute()}:{time.time_ns()}".encode()
    return f"wf_launch.{Path(run_dir).name[:40]}.{hashlib.sha1(key).hexdigest()[:12]}"


class WfRaySupervisor:
    """Runs one run's :class:`~.monitor.RayRun` (a threaded Ray actor: :func:`start_supervisor`)."""

    def __init__(self, run_dir: str) -> None:
        logger.remove()
        logger.configure(extra={"label": "supervisor", "rank": -1})
        log = str(Path(run_dir) / files.LAUNCHER_LOG)
        logger.add(log, format=FILE_FORMAT, level="DEBUG", buffering=1)
        self.run_dir = run_dir
        self.job: Any = None
        self.ready = threading.Event()

    def run(self, plan: Any, opts: Any, exit_when_done: bool) -> str:
        """Run the run to its end; its status. A detached supervisor then ends itself."""
        try:
            self.job = RayRun(plan, opts)
            self.ready.set()
            status = str(self.job.run().status)
        except BaseException as exc:  # recorded: the launching command is gone
            message = f"the run's supervisor failed: {exc}"
            logger.opt(exception=exc).error(
                f"the run's supervisor failed: {type(exc).__name__}: {exc}"
            )
            failure = {"cause": "launcher_error", "type": type(exc).__name__, "message": message}
            record = RunRecord.finalize(
                self.run_dir, Status.FAILED, launcher="ray", failure=failure
            )
            status = str(record.status)
        logger.complete()
        if exit_when_done:
            rt.exit_actor()
        return status

    def cancel(self) -> bool:
        """Ask the run to stop (SIGTERM to its ranks, then 'cancelled'); False before it started."""
        if not self.ready.wait(timeout=30) or self.job is None:
            return False
        self.job.cancelled.set()
        return True


def start_supervisor(plan: Any, opts: Any, detached: bool) -> tuple[Any, Any]:
    """Start the run's supervisor (``opts.supervisor`` in :data:`NAMESPACE`); (actor, run ref)."""
    if "cls" not in _CLASS:
        _CLASS["cls"] = rt.remote(WfRaySupervisor)
    options: dict[str, Any] = {
        "name": opts.supervisor,
        "namespace": NAMESPACE,
        "num_cpus": 0,
        "max_concurrency": 4,
        "max_restarts": 0,
        "scheduling_strategy": rt.on_node(rt.current_node_id(), soft=True),
    }
    if detached:
        options["lifetime"] = "detached"
    actor = _CLASS["cls"].options(**options).remote(str(plan.run_dir))
    return actor, actor.run.remote(plan, opts, detached)
