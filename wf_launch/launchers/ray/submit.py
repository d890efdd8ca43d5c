"""The launching command's side: one run (watched here, or handed to a detached supervisor),
or a sweep's batch (:class:`RayBatch`: points checked as prepared, then started side by side).

A relative run directory, a missing Ray, a cluster that does not answer or cannot hold the run
are config errors before anything starts (exit 2, recorded ``invalid``).
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from ...config.fields import ConfigError, config_error
from ...observe.live import LiveView
from ...rank.ft import ft_enabled
from ...rundir.outcome import RunOutcome
from ...rundir.record import RunRecord, Status
from ..interrupt import Stopped, say, stop_signals
from ..launch_plan import LaunchPlan
from . import ray_adapter as rt
from . import state
from .cluster import Connection, alive_nodes, check_fits, connect
from .monitor import NAMESPACE, RayRun, RunOptions, forwarded_env, start_supervisor, supervisor_name
from .poll import live_state
from .replicas import launch_replicas

START_WAIT_S = 60.0
"""How long the launching command waits for a supervisor to take its run over."""


def _invalid(plan: LaunchPlan, message: str) -> RunOutcome:
    say(f"config error: {message}")
    failure = {"cause": "invalid_config", "message": message}
    record = RunRecord.finalize(plan.run_dir, Status.INVALID, **plan.run_info(), failure=failure)
    return RunOutcome.of(record, plan.run_dir, "")


def _options(
    conn: Connection,
    plan: LaunchPlan | None = None,
    env: dict[str, str] | None = None,
    **extra: Any,
) -> RunOptions:
    """The run's options; with ``plan``, those of a run its own supervisor monitors (``env``: more
    variables for its ranks)."""
    if plan is not None:
        extra.update(show=False, namespace=NAMESPACE, supervisor=supervisor_name(plan.run_dir))
    forward, path = forwarded_env()
    return RunOptions(
        address=conn.address,
        private=conn.instance is not None,
        token_file=str(conn.instance.token_file) if conn.instance else "",  # for this user's tools
        forward={**forward, **(env or {})},
        path=path,
        **extra,
    )


def launch(plan: LaunchPlan) -> RunOutcome:
    """Check the run against the cluster, then run it here or hand it to a detached supervisor."""
    lc = plan.launcher_config
    batch = _CURRENT.get()
    try:
        if not Path(plan.run_dir).is_absolute():
            raise config_error(
                "hydra.run.dir",
                str(plan.run_dir),
                "an absolute path on storage every node of the "
                "cluster sees (ranks on other nodes write their logs and records there)",
            )
        rt.is_connected()  # imports Ray: RayMissing names the install command
        replicas = _ft_replicas(plan, batch is not None)
        if batch is not None:
            return batch.add(plan)
        cpus = replicas * plan.world_size * float(lc.cpus_per_rank)
        conn = connect(lc, str(plan.run_dir), plan.world_size, cpus=cpus)
    except (ConfigError, rt.RayMissing) as exc:
        return _invalid(plan, str(exc))
    # Ctrl-C before any rank started goes on up: the app records it as for every launcher.
    try:
        where = lc.address or "this machine (a private instance)"
        try:
            # replica groups side by side: together anywhere, or each on its launcher.nodes
            check_fits(alive_nodes(), lc, plan.world_size * (1 if lc.nodes else replicas), where)
        except ConfigError as exc:
            return _invalid(plan, str(exc))
        if replicas > 1:
            return launch_replicas(plan, lambda p, env: _options(conn, p, env))
        where = "a private Ray instance" if conn.instance else f"the Ray cluster at {conn.address}"
        logger.info(
            f"launching {plan.world_size} rank(s) on {where}: {plan.layout.describe()}, "
            f"task={plan.task}, run dir {plan.run_dir}"
        )
        if lc.wait:
            return RayRun(plan, _options(conn)).run()
        return _detach(plan, _options(conn, plan, detached=True))
    finally:
        conn.close()


def _ft_replicas(plan: LaunchPlan, in_sweep: bool) -> int:
    """``ft.replicas`` under ``ft=torchft`` (else 1); ConfigError in a sweep."""
    if not ft_enabled(plan.config):
        return 1
    if in_sweep:
        raise config_error(
            "ft",
            "torchft",
            "one run at a time on launcher=ray (its replica groups are the points run side by "
            "side): no -m sweep; or launcher=local",
        )
    return int(plan.config["ft"]["replicas"])


def _wait_taken_over(run_dirs: list[Path], timeout_s: float = START_WAIT_S) -> list[Path]:
    """Wait until each run's supervisor took it over (left 'submitted'); those that did not."""
    deadline = time.monotonic() + timeout_s
    waiting = list(run_dirs)
    while waiting and time.monotonic() < deadline:
        waiting = [
            d
            for d in waiting
            if (state.read(d) or {}).get("state") == "submitted" and RunRecord.read(d) is None
        ]
        if waiting:
            time.sleep(0.2)
    return waiting


def _submitted(plan: LaunchPlan, **fields: Any) -> None:
    """``ray_run.json`` of a run handed to a supervisor that has not taken it over yet."""
    command = f"python -m wf_launch.status {plan.run_dir}"
    state.update(
        plan.run_dir,
        state="submitted",
        world_size=plan.world_size,
        status_command=command,
        **fields,
    )


def _detach(plan: LaunchPlan, opts: RunOptions) -> RunOutcome:
    where = {"address": opts.address, "namespace": opts.namespace, "supervisor": opts.supervisor}
    _submitted(plan, **where, detached=True, private=False)
    start_supervisor(plan, opts, detached=True)
    if _wait_taken_over([plan.run_dir]):
        message = f"the run's supervisor {opts.supervisor} did not start within {START_WAIT_S:g} s"
        failure = {"cause": "launcher_error", "message": message}
        record = RunRecord.finalize(
            plan.run_dir, Status.FAILED, launcher="ray", task=plan.task, failure=failure
        )
        return RunOutcome.of(record, plan.run_dir, message)
    logger.info(
        f"started Ray run {opts.supervisor} (detached) on {opts.address}: {plan.world_size} "
        f"rank(s), task={plan.task}, run dir {plan.run_dir}"
    )
    return RunOutcome(
        Status.SUBMITTED,
        plan.run_dir,
        f"started Ray run {opts.supervisor} on {opts.address}; "
        f"status: python -m wf_launch.status {plan.run_dir}",
    )


_CURRENT: contextvars.ContextVar[RayBatch | None] = contextvars.ContextVar(
    "wf_launch_ray_batch", default=None
)
"""The batch :func:`launch` prepares into now (None: run each launch at once)."""


@dataclass
class _Point:
    plan: LaunchPlan
    opts: RunOptions | None = None
    actor: Any = None
    ref: Any = None


class RayBatch:
    """A sweep's Ray points: checked as they are prepared (against the cluster they join), then
    started together, one supervisor each. A sweep with ``launcher.address=null`` starts one
    private instance sized to hold every point side by side."""

    def __init__(self, sweep_dir: Path) -> None:
        self.sweep_dir = Path(sweep_dir).absolute()
        self.points: list[_Point] = []
        self.conn: Connection | None = None
        self.address: Any = None

    def __len__(self) -> int:
        return len(self.points)

    @contextmanager
    def collecting(self) -> Iterator[RayBatch]:
        """While open, :func:`launch` prepares points into this batch; an exception drops them."""
        token = _CURRENT.set(self)
        try:
            yield self
        except BaseException:
            self.close()
            raise
        finally:
            _CURRENT.reset(token)

    def close(self) -> None:
        self.points.clear()
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def add(self, plan: LaunchPlan) -> RunOutcome:
        """Check one point (against the cluster when it joins one) and keep it for :meth:`run`."""
        lc = plan.launcher_config
        try:
            if self.points and lc.address != self.address:
                raise config_error(
                    "launcher.address",
                    lc.address,
                    "every point of a sweep goes to one cluster "
                    f"(the first point's: {self.address!r})",
                )
            self.address = lc.address
            if lc.address is not None:
                if self.conn is None:
                    self.conn = connect(lc, str(self.sweep_dir), plan.world_size)
                check_fits(alive_nodes(), lc, plan.world_size, lc.address)
        except (ConfigError, rt.RayMissing) as exc:
            return _invalid(plan, str(exc))
        _submitted(plan, detached=not lc.wait)
        self.points.append(_Point(plan))
        return RunOutcome(Status.SUBMITTED, plan.run_dir)

    def run(self) -> dict[Path, RunOutcome]:
        """Start every point, then wait for those with ``wait=true``; the outcome of each."""
        try:
            if self.conn is None:
                lc = self.points[0].plan.launcher_config
                cpus = sum(p.plan.world_size * float(lc.cpus_per_rank) for p in self.points)
                self.conn = connect(lc, str(self.sweep_dir), 1, cpus=cpus)
            for point in self.points:
                lc = point.plan.launcher_config
                point.opts = opts = _options(
                    self.conn, point.plan, detached=not lc.wait, queue_dir=str(self.sweep_dir)
                )
                state.update(
                    point.plan.run_dir,
                    address=opts.address,
                    namespace=NAMESPACE,
                    supervisor=opts.supervisor,
                    private=opts.private,
                )
                point.actor, point.ref = start_supervisor(point.plan, opts, opts.detached)
            logger.info(
                f"started {len(self.points)} Ray run(s) side by side on {self.conn.address}"
            )
            _wait_taken_over([p.plan.run_dir for p in self.points])
            waited = [p for p in self.points if p.opts is not None and not p.opts.detached]
            return _wait_points(waited) if waited else {}
        finally:
            self.close()


def _wait_points(points: list[_Point]) -> dict[Path, RunOutcome]:
    """Wait for the points' supervisors, showing their states; a stop signal cancels them all."""
    pending = {p.ref: p for p in points}
    dirs = [p.plan.run_dir for p in points]
    live = LiveView(dirs, write=logger.info, state_of=live_state, warn=logger.warning)
    try:
        with stop_signals(True):
            while pending:
                live.tick()
                for ref in rt.wait(list(pending), 0.5)[0]:
                    run_dir = pending.pop(ref).plan.run_dir
                    outcome = _outcome_of(run_dir)
                    if outcome.exit_code:
                        say(f"{run_dir} {outcome.status}: {outcome.summary}")
            live.tick()  # the last states
    except (KeyboardInterrupt, Stopped) as exc:
        say(f"{str(exc) or 'interrupted'}: cancelling {len(pending)} Ray run(s)")
        for point in pending.values():
            point.actor.cancel.remote()
        rt.wait_all(list(pending), 120.0)
    finally:
        live.close()
        for point in points:
            rt.kill(point.actor)
    return {d: _outcome_of(d) for d in dirs}


def _outcome_of(run_dir: Path) -> RunOutcome:
    record = RunRecord.read(run_dir)
    if record is None or not record.final:
        return RunOutcome(
            Status.UNKNOWN, run_dir, "the run's supervisor ended without a final record"
        )
    message = str((record.failure or {}).get("message") or "")
    return RunOutcome.of(record, run_dir, message if record.exit_code else None)
