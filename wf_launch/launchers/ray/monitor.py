"""A Ray run from its first attempt to its record: attempts, restarts, interruptions,
``result.json``.

:class:`RayRun` runs in the launching command (``launcher.wait=true``: it shows the run live and
handles Ctrl-C, SIGTERM and SIGHUP) or in the run's supervisor actor (``wait=false`` and sweeps:
:mod:`.supervisor`; ``status --cancel`` sets its cancel flag). Each attempt is an
:class:`~.attempt.Attempt`. After a failure or a preemption, while ``launcher.max_restarts``
allows, every rank restarts in a new placement group (on the nodes still alive) and the task
resumes from its newest checkpoint; ``result.json``'s ``attempts`` records each attempt as for
the local launcher. An interrupted run's ranks get SIGTERM first (the task saves at its next
step) and ``launcher.shutdown_timeout_s`` to leave.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from ...config.fields import ConfigError
from ...observe.live import LiveView
from ...rundir import attempts
from ...rundir.environment import record_environment
from ...rundir.outcome import RunOutcome
from ...rundir.record import RunRecord, Status
from ...rundir.resume import resume_hint
from ..base import CTRL_C_NOTICE
from ..interrupt import Stopped, stop_signals
from . import state
from .attempt import Attempt, Ended
from .cluster import alive_nodes, check_fits, node_reachable
from .failure import Verdict
from .placement import LAUNCHER_VARS, describe_slots

__all__ = ["RayRun", "RunOptions", "forwarded_env", "stop_signals"]

NODE_DEATH_WAIT_S = 45.0
"""How long a restart waits for the GCS to list a node whose raylet stopped answering as dead."""


def forwarded_env(environ: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """What the ranks get from the launching shell: its ``WF_*`` variables and ``PYTHONPATH`` (as
    sbatch's
    ``--export=ALL`` gives SLURM tasks), and the ``PYTHONPATH`` entries to put on their
    ``sys.path``."""
    env = os.environ if environ is None else environ
    keep = {k: v for k, v in env.items() if k.startswith("WF_") and k not in LAUNCHER_VARS}
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if path:
        keep["PYTHONPATH"] = os.pathsep.join(path)
    return keep, path


@dataclass
class RunOptions:
    """Where the run is monitored from and what its records say about it."""

    address: str = ""
    private: bool = False
    token_file: str = ""
    detached: bool = False
    supervisor: str | None = None
    namespace: str | None = None
    queue_dir: str | None = None
    show: bool = True
    forward: dict[str, str] = field(default_factory=dict)
    path: list[str] = field(default_factory=list)


def _hosts() -> dict[str, str]:
    """Each alive node's host name, by node id."""
    return {n.node_id: n.host for n in alive_nodes()}


class RayRun:
    """Every attempt of one run, and its record."""

    def __init__(self, plan: Any, opts: RunOptions) -> None:
        self.plan, self.lc, self.opts = plan, plan.launcher_config, opts
        self.run_dir = Path(plan.run_dir)
        self.cancelled = threading.Event()
        self.launch_time = time.time()
        self.base = attempts.count(self.run_dir)
        self.live: Any = None
        self._nodes: tuple[float, dict[str, Any]] = (0.0, {})
        self.info = {
            "launcher": "ray",
            "task": plan.task,
            "overrides": plan.overrides,
            "run_dir": str(self.run_dir),
            "environment": record_environment(self.run_dir),
        }

    # ------------------------------------------------------------ what attempts ask
    def check_cancel(self) -> None:
        """:class:`Stopped` ('cancel') once ``status --cancel`` asked the run's supervisor to stop
        it."""
        if self.cancelled.is_set():
            raise Stopped("cancel")

    def tick(self) -> None:
        if self.live is not None:
            self.live.tick()

    def forward_env(self) -> tuple[dict[str, str], list[str]]:
        """The launching shell's variables for every rank (with ``OMP_NUM_THREADS``), and its
        ``PYTHONPATH`` entries."""
        threads = str(max(1, int(float(self.lc.cpus_per_rank))))
        return {"OMP_NUM_THREADS": threads, **self.opts.forward}, list(self.opts.path)

    def queue_busy(self) -> bool:
        """Whether another point of this run's sweep runs now (then this one waits for room without
        a bound)."""
        if not self.opts.queue_dir:
            return False
        busy = ("starting", "running", "stopping")
        return any(
            sibling.is_dir()
            and sibling.resolve() != self.run_dir.resolve()
            and (state.read(sibling) or {}).get("state") in busy
            for sibling in Path(self.opts.queue_dir).iterdir()
        )

    def node_alive(self, node: str) -> bool:
        """Whether the GCS lists ``node`` alive and its raylet answers (cached for a second)."""
        stamp, nodes = self._nodes
        if time.monotonic() - stamp > 1.0:
            nodes = {n.node_id: (n, node_reachable(n)) for n in alive_nodes()}
            self._nodes = (time.monotonic(), nodes)
        found = nodes.get(node)
        return bool(found and found[1])

    # ------------------------------------------------------------ the run
    def run(self) -> RunOutcome:
        """Every attempt until one ends the run; the run's outcome (``result.json`` finalized)."""
        lc = self.lc
        state.update(
            self.run_dir,
            address=self.opts.address,
            namespace=self.opts.namespace,
            supervisor=self.opts.supervisor,
            detached=self.opts.detached,
            private=self.opts.private,
            token_file=self.opts.token_file or None,
            world_size=self.plan.world_size,
            nodes=lc.nodes,
            started_at=self.launch_time,
            launcher_pid=os.getpid(),
            launcher_host=socket.gethostname(),
            state="placing",
            status_command=f"python -m wf_launch.status {self.run_dir}",
        )
        self._open_live()
        try:
            with stop_signals(self.opts.show):
                return self._attempts()
        finally:
            if self.live is not None:
                self.live.close()
            state.update(self.run_dir, state="ended")

    def _attempts(self) -> RunOutcome:
        restart = 0
        while True:
            att = Attempt(self, self.base + restart, restart)
            ended = self._attempt(att)
            if att.where:
                try:
                    attempts.close(
                        self.run_dir, att.number, self.plan.world_size, ended.ended_by or ended.kind
                    )
                except OSError as exc:  # a full disk: the run is still recorded
                    logger.warning(f"could not write an attempt marker in {self.run_dir} ({exc})")
            if (
                ended.kind in ("failed", "preempted")
                and restart < int(self.lc.max_restarts)
                and self._can_restart(ended)
            ):
                restart += 1
                logger.warning(
                    f"attempt {att.number} ended ({ended.ended_by or ended.kind}); restarting "
                    "every rank "
                    f"in a new placement group (restart {restart} of launcher.max_restarts="
                    f"{self.lc.max_restarts})"
                )
                continue
            return self._finalize(ended, att)

    def _attempt(self, att: Attempt) -> Ended:
        write = logger.info if self.opts.show else logger.debug
        try:
            ended = att.place() or att.start_actors()
            if ended is None:
                write(
                    f"attempt {att.number}: {self.plan.world_size} rank(s) placed: "
                    + "; ".join(describe_slots(att.slots, _hosts()))
                )
                att.start_ranks(write)
                ended = att.watch()
        except (KeyboardInterrupt, Stopped) as exc:
            name = exc.name if isinstance(exc, Stopped) else "SIGINT"
            if name == "SIGINT" and self.opts.show:
                logger.warning(CTRL_C_NOTICE)
            ended = att.stop("cancelled" if name == "cancel" else "interrupted", name)
        finally:
            att.teardown()
        return ended

    def _can_restart(self, ended: Ended) -> bool:
        """Whether a restart can place the run again: a dead node gone from the GCS, the run fitting
        what is left."""
        cause = ended.verdict.cause if ended.verdict is not None else {}
        if cause.get("cause") in ("placement_timeout", "init_timeout", "invalid_config"):
            return False
        if cause.get("cause") == "node_died":
            deadline = time.monotonic() + NODE_DEATH_WAIT_S
            while (
                any(n.node_id == cause.get("node") for n in alive_nodes())
                and time.monotonic() < deadline
            ):
                time.sleep(0.5)
        try:
            check_fits(
                alive_nodes(), self.lc, self.plan.world_size, self.opts.address or "this cluster"
            )
        except ConfigError as exc:
            logger.error(f"cannot restart: {exc}")
            return False
        return True

    # ------------------------------------------------------------ the record
    def _open_live(self) -> None:
        if not self.opts.show:
            return
        self.live = LiveView([self.run_dir], write=logger.info, warn=logger.warning)

    def _facts(self, att: Attempt) -> dict[str, Any]:
        placement = state.record_placement(att.where)
        return {
            **self.info,
            "placement": placement,
            "hosts": sorted({str(p["host"]) for p in placement.values() if p.get("host")}),
            "ray": {
                "address": self.opts.address,
                "private": self.opts.private,
                "nodes": sorted({str(p["node"]) for p in placement.values() if p.get("node")}),
            },
            "attempts": attempts.collect(self.run_dir),
            "timings": {"wall_s": round(time.time() - self.launch_time, 4)},
        }

    def _finalize(self, ended: Ended, att: Attempt) -> RunOutcome:
        facts = self._facts(att)
        if ended.kind == "ok":
            return RunOutcome.of(RunRecord.finalize(self.run_dir, Status.OK, **facts), self.run_dir)
        if ended.kind in ("interrupted", "cancelled"):
            return self._stopped(ended, facts)
        verdict = ended.verdict or Verdict(
            {"rank": -1, "cause": "unknown", "message": ended.ended_by},
            ended.ended_by,
            ended.ended_by,
        )
        status = Status.INVALID if ended.kind == "invalid" else Status.FAILED
        if ended.kind == "preempted":
            verdict = Verdict(
                {
                    "rank": -1,
                    "cause": "preempted",
                    "message": f"{ended.ended_by}; no restart left "
                    f"(launcher.max_restarts={self.lc.max_restarts})",
                },
                ended.ended_by,
                ended.ended_by,
            )
        record = RunRecord.finalize(self.run_dir, status, **facts, failure=verdict.cause)
        return RunOutcome.of(record, self.run_dir, verdict.summary)

    def _stopped(self, ended: Ended, facts: dict[str, Any]) -> RunOutcome:
        if ended.kind == "cancelled":
            summary = "cancelled: every rank was stopped"
            record = RunRecord.finalize(
                self.run_dir,
                Status.CANCELLED,
                **facts,
                failure={"cause": "cancelled", "message": summary},
            )
            return RunOutcome.of(record, self.run_dir, summary)
        name = ended.signal or "SIGTERM"
        by_rank = ended.ended_by.startswith("stop flag")
        summary = (
            f"stopped by {name} to a rank (stop flag): the task saved and returned"
            if by_rank
            else f"interrupted by {name}: every rank was stopped"
        )
        record = RunRecord.finalize(
            self.run_dir,
            Status.INTERRUPTED,
            signal_name=name,
            **facts,
            failure={"cause": "interrupt", "signal": name, "message": summary},
        )
        hint = resume_hint(self.run_dir, self.plan.overrides)
        return RunOutcome.of(record, self.run_dir, f"{summary}\n  {hint}" if hint else summary)
