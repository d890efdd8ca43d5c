"""A Ray run from its first attempt to its record: attempts, restarts, stops, ``result.json``.

:class:`RayRun` runs in the launching command (``launcher.wait=true``: it shows the run live
and handles Ctrl-C, SIGTERM and SIGHUP) or in the run's supervisor actor
(:class:`WfRaySupervisor`): for ``wait=false`` (*detached*: it outlives the command, ends
itself once the run is recorded, ``status --cancel`` finds it by name) and for a sweep's
points. The supervisor owns the run's placement group and actors: if it dies, they go too.
After a failure or a preemption, while ``launcher.max_restarts`` allows, every rank restarts in
a new placement group on the nodes still alive and resumes from the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
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
from ...rank.ft import append_event, ft_enabled
from ...rank.ranklog import FILE_FORMAT
from ...rundir import attempts, files
from ...rundir.environment import record_environment
from ...rundir.outcome import RunOutcome
from ...rundir.record import RunRecord, Status
from ..base import CTRL_C_NOTICE
from ..ft_record import last_step
from ..interrupt import Stopped, interrupted, name_ctrl_c, stop_signals
from . import ray_adapter as rt
from . import state
from .attempt import Attempt, Ended
from .cluster import alive_nodes, check_fits
from .placement import LAUNCHER_VARS, describe_slots

NODE_DEATH_WAIT_S = 45.0
"""How long a restart waits for the GCS to list a node whose raylet stopped answering as dead."""


def forwarded_env(environ: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """What the ranks get from the launching shell: its ``WF_*`` variables and ``PYTHONPATH``
    (as sbatch's ``--export=ALL``), and the ``PYTHONPATH`` entries for their ``sys.path``."""
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


class RayRun:
    """Every attempt of one run, and its record."""

    def __init__(self, plan: Any, opts: RunOptions) -> None:
        self.plan, self.lc, self.opts = plan, plan.launcher_config, opts
        self.run_dir = Path(plan.run_dir)
        self.cancelled = threading.Event()
        self.launch_time = time.time()
        self.base = attempts.count(self.run_dir)
        self.live: Any = None
        self._nodes: tuple[float, dict[str, bool]] = (0.0, {})
        self.info = {
            **plan.run_info(),
            "launcher": "ray",
            "environment": record_environment(self.run_dir),
        }

    def check_cancel(self) -> None:
        """:class:`Stopped` ('cancel') once ``status --cancel`` asked the supervisor to stop."""
        if self.cancelled.is_set():
            raise Stopped("cancel")

    def tick(self) -> None:
        if self.live is not None:
            self.live.tick()

    def queue_busy(self) -> bool:
        """Whether another point of this run's sweep runs now (then this one waits for room)."""
        if not self.opts.queue_dir:
            return False
        return any(
            sibling.is_dir()
            and sibling.resolve() != self.run_dir.resolve()
            and (state.read(sibling) or {}).get("state") in ("starting", "running", "stopping")
            for sibling in Path(self.opts.queue_dir).iterdir()
        )

    def node_alive(self, node: str) -> bool:
        """Whether the GCS lists ``node`` alive and its raylet answers (cached for a second)."""
        stamp, nodes = self._nodes
        if time.monotonic() - stamp > 1.0:
            nodes = {n.node_id: n.reachable() for n in alive_nodes()}
            self._nodes = (time.monotonic(), nodes)
        return bool(nodes.get(node))

    def run(self) -> RunOutcome:
        """Every attempt until one ends the run; the run's outcome (``result.json`` finalized)."""
        opts = self.opts
        state.update(
            self.run_dir,
            **{k: getattr(opts, k) for k in ("address", "namespace", "supervisor", "detached")},
            private=opts.private,
            token_file=opts.token_file or None,
            world_size=self.plan.world_size,
            nodes=self.lc.nodes,
            started_at=self.launch_time,
            launcher_pid=os.getpid(),
            launcher_host=socket.gethostname(),
            state="placing",
            status_command=f"python -m wf_launch.status {self.run_dir}",
        )
        if self.opts.show:
            self.live = LiveView([self.run_dir], write=logger.info, warn=logger.warning)
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
                if ft_enabled(self.plan.config):
                    _replica_failed(self.run_dir, restart, ended)
                logger.warning(
                    f"attempt {att.number} ended ({ended.ended_by or ended.kind}); restarting "
                    f"every rank in a new placement group (restart {restart} of "
                    f"launcher.max_restarts={self.lc.max_restarts})"
                )
                continue
            return self._finalize(ended, att)

    def _attempt(self, att: Attempt) -> Ended:
        write = logger.info if self.opts.show else logger.debug
        try:
            ended = att.place() or att.start_actors()
            if ended is None:
                hosts = {n.node_id: n.host for n in alive_nodes()}
                placed = "; ".join(describe_slots(att.slots, hosts))
                write(f"attempt {att.number}: {self.plan.world_size} rank(s) placed: {placed}")
                att.start_ranks(write)
                ended = att.watch()
        except (KeyboardInterrupt, Stopped) as exc:
            name = exc.name if isinstance(exc, Stopped) else "SIGINT"
            if name == "SIGINT" and self.opts.show:
                logger.warning(CTRL_C_NOTICE)
            ended = att.stop("cancelled" if name == "cancel" else "interrupted", name)
            if name == "SIGINT":
                with contextlib.suppress(OSError):  # the record's words, never a lost record
                    name_ctrl_c(self.run_dir, att.number)
        finally:
            att.teardown()
        return ended

    def _can_restart(self, ended: Ended) -> bool:
        """Whether a restart can place the run again on what is left of the cluster."""
        cause = ended.verdict.cause if ended.verdict is not None else {}
        if cause.get("cause") in ("placement_timeout", "init_timeout", "invalid_config"):
            return False
        deadline = time.monotonic() + NODE_DEATH_WAIT_S
        while (
            cause.get("cause") == "node_died"
            and any(n.node_id == cause.get("node") for n in alive_nodes())
            and time.monotonic() < deadline
        ):
            time.sleep(0.5)
        try:
            where = self.opts.address or "this cluster"
            check_fits(alive_nodes(), self.lc, self.plan.world_size, where)
        except ConfigError as exc:
            logger.error(f"cannot restart: {exc}")
            return False
        return True

    def _finalize(self, ended: Ended, att: Attempt) -> RunOutcome:
        placement = state.record_placement(att.where)
        nodes = sorted({str(p["node"]) for p in placement.values() if p.get("node")})
        facts = {
            **self.info,
            "placement": placement,
            "hosts": sorted({str(p["host"]) for p in placement.values() if p.get("host")}),
            "ray": {"address": self.opts.address, "private": self.opts.private, "nodes": nodes},
            "attempts": attempts.collect(self.run_dir),
            "timings": {"wall_s": round(time.time() - self.launch_time, 4)},
        }
        run_dir, why = self.run_dir, ended.ended_by
        if ended.kind == "ok":
            return RunOutcome.of(RunRecord.finalize(run_dir, Status.OK, **facts), run_dir)
        if ended.kind == "cancelled":
            summary = "cancelled: every rank was stopped"
            failure = {"cause": "cancelled", "message": summary}
            record = RunRecord.finalize(run_dir, Status.CANCELLED, **facts, failure=failure)
            return RunOutcome.of(record, run_dir, summary)
        if ended.kind == "interrupted":
            name = ended.signal or "SIGTERM"
            summary = (
                f"stopped by {name} to a rank (stop flag): the task saved and returned"
                if why.startswith("stop flag")
                else f"interrupted by {name}: every rank was stopped"
            )
            return interrupted(run_dir, name, summary, **facts)
        cause, summary = self._failure(ended)
        status = Status.INVALID if ended.kind == "invalid" else Status.FAILED
        record = RunRecord.finalize(run_dir, status, **facts, failure=cause)
        return RunOutcome.of(record, run_dir, summary)

    def _failure(self, ended: Ended) -> tuple[dict[str, Any], str]:
        """The failure record and summary of a failed, invalid or preempted run."""
        if ended.verdict is not None and ended.kind != "preempted":
            return ended.verdict.cause, ended.verdict.summary
        message = ended.ended_by
        if ended.kind == "preempted":
            message += f"; no restart left (launcher.max_restarts={self.lc.max_restarts})"
        kind = "preempted" if ended.kind == "preempted" else "unknown"
        return {"rank": -1, "cause": kind, "message": message}, ended.ended_by


def _replica_failed(run_dir: Path, restart: int, ended: Ended) -> None:
    """``ft=torchft``: the replica group's failure, in its events (the ``ft`` section's
    recoveries): Ray knows no exit codes, so the rank and the cause of the verdict."""
    cause = ended.verdict.cause if ended.verdict is not None else {}
    what = str(cause.get("cause") or ended.kind)
    append_event(
        run_dir,
        event="failed",
        attempt=restart,
        rank=int(cause.get("rank", -1)),
        cause=what if what in ("died", "node_died", "stuck") else str(cause.get("type") or what),
        failed_at_step=last_step(run_dir),
    )


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
