"""``ft=torchft`` on Ray: one placement group per replica group, each its own supervised run.

Each replica group is an ordinary Ray run of the engine layout (:class:`~.monitor.RayRun`, in a
supervisor actor of its own, as a sweep's point) in ``RUN_DIR/replicas/{k}``, with
``launcher.max_restarts = ft.max_replica_restarts``: a rank that dies, or a node that is lost,
ends only its replica group's placement group and actors; the group restarts in a new placement
group wherever the cluster has room, and heals from a live peer. The launching command starts
and supervises torchft's Lighthouse (on this machine's address in the cluster), tears down a
replica group that hangs (:mod:`..ft_hang`, through Ray to whichever node), cancels every group
on Ctrl-C or SIGTERM, and writes the run's ``result.json`` with its ``ft`` section.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from ...config.ft import FtConfig
from ...observe.live import LiveView
from ...rank.ft import ENDED, FT_REPLICA_ENV, LIGHTHOUSE_ENV, RUST_LOG, write_mark
from ...rundir import files
from ...rundir.outcome import RunOutcome
from ...rundir.record import RecordError, RunRecord
from ..ft_hang import HangWatch
from ..ft_lighthouse import Lighthouse, LighthouseFailed
from ..ft_replicas import (
    lighthouse_failed,
    prepare_replica_dir,
    record_replicas,
    start_lighthouse,
)
from ..interrupt import Stopped, say, stop_signals
from . import ray_adapter as rt
from . import state
from .monitor import RunOptions, start_supervisor
from .poll import live_state, signal_ranks

if TYPE_CHECKING:
    from ..launch_plan import LaunchPlan

__all__ = ["launch_replicas"]

POLL_S = 0.2
CANCEL_WAIT_S = 120.0


def _replica_plan(plan: LaunchPlan, k: int, ft: FtConfig) -> LaunchPlan:
    """Replica group ``k``'s plan: its run directory and restarts, waited for here."""
    config = {**plan.config, "launcher": {**plan.config["launcher"]}}
    config["launcher"].update(max_restarts=ft.max_replica_restarts, wait=True)
    return replace(plan, config=config, run_dir=prepare_replica_dir(plan, k))


def _ft_env(k: int, lighthouse: str) -> dict[str, str]:
    """What replica group ``k``'s ranks get besides the launcher's own variables."""
    return {
        FT_REPLICA_ENV: str(k),
        LIGHTHOUSE_ENV: lighthouse,
        RUST_LOG: os.environ.get(RUST_LOG, "warn"),
    }


def _kill_group(replica_dir: Path, _pids: dict[int, int]) -> None:
    """The hang watch's tear-down on Ray: SIGKILL every rank of the group, on whichever node."""
    signal_ranks(replica_dir, signal.SIGKILL)


def _exit_code(replica_dir: Path) -> int | None:
    try:
        record = RunRecord.read(replica_dir)
    except RecordError:
        return None
    return record.exit_code if record is not None and record.final else None


def launch_replicas(
    plan: LaunchPlan, options_for: Callable[[LaunchPlan, dict[str, str]], RunOptions]
) -> RunOutcome:
    """Start the Lighthouse (unless one runs) and every replica group; wait; record the run.

    ``options_for(replica plan, extra env)``: the replica group's :class:`RunOptions` (this
    process is connected to the cluster).
    """
    ft = FtConfig.from_dict(plan.config["ft"])
    t0 = time.time()
    try:  # on this machine's address in the cluster: the ranks on other nodes reach it there
        lighthouse, address = start_lighthouse(plan, ft, rt.node_ip())
    except LighthouseFailed as exc:
        return lighthouse_failed(plan, str(exc))
    logger.info(
        f"ft: {ft.replicas} replica group(s) of {plan.layout.describe()} on Ray, one placement "
        f"group each, min_replicas {ft.min_replicas}, task={plan.task}, run dir {plan.run_dir}"
    )
    supervisors: dict[int, tuple[Any, Any]] = {}
    opts: RunOptions | None = None
    signal_name = None
    try:
        for k in range(ft.replicas):
            plan_k = _replica_plan(plan, k, ft)
            opts = options_for(plan_k, _ft_env(k, address))
            state.update(
                plan_k.run_dir,
                address=opts.address,
                namespace=opts.namespace,
                supervisor=opts.supervisor,
                private=opts.private,
            )
            supervisors[k] = start_supervisor(plan_k, opts, False)
        _record_state(plan, opts, ft)
        watch = HangWatch(plan.run_dir, ft.replicas, plan.world_size, ft.hang_after_s, _kill_group)
        signal_name = _supervise(plan, supervisors, lighthouse, watch)
    finally:
        for actor, _ in supervisors.values():
            rt.kill(actor)
        if lighthouse is not None:
            lighthouse.stop()
        state.update(plan.run_dir, state="ended")
    codes = {k: _exit_code(files.ft_replica_dir(plan.run_dir, k)) for k in range(ft.replicas)}
    restarts = len(lighthouse.restarts) if lighthouse is not None else 0
    ray_facts = {"address": opts.address, "private": opts.private} if opts else {}
    return record_replicas(plan, ft, codes, restarts, signal_name, time.time() - t0, ray=ray_facts)


def _record_state(plan: LaunchPlan, opts: RunOptions | None, ft: FtConfig) -> None:
    """The whole run's ``ray_run.json``: watched by this command (``status``, ``--cancel``)."""
    state.update(
        plan.run_dir,
        address=opts.address if opts else None,
        private=opts.private if opts else False,
        world_size=plan.world_size * ft.replicas,
        ft_replicas=ft.replicas,
        started_at=time.time(),
        launcher_pid=os.getpid(),
        launcher_host=socket.gethostname(),
        state="running",
        status_command=f"python -m wf_launch.status {plan.run_dir}",
    )


def _supervise(
    plan: LaunchPlan,
    supervisors: dict[int, tuple[Any, Any]],
    lighthouse: Lighthouse | None,
    watch: HangWatch,
) -> str | None:
    """Wait for every replica group, restarting the Lighthouse when it dies and tearing down a
    hung group; on Ctrl-C or SIGTERM cancel them all. The signal that stopped the run, if any."""
    pending = {ref: k for k, (_, ref) in supervisors.items()}
    dirs = [files.ft_replica_dir(plan.run_dir, k) for k in sorted(supervisors)]
    live = LiveView(dirs, write=logger.info, state_of=live_state, warn=logger.warning)
    try:
        with stop_signals(True):
            while pending:
                live.tick()
                for ref in rt.wait(list(pending), POLL_S)[0]:
                    k = pending.pop(ref)  # its launch is over: the others stop waiting for it
                    write_mark(files.ft_replica_dir(plan.run_dir, k), ENDED)
                if lighthouse is not None and not lighthouse.alive() and pending:
                    try:
                        lighthouse.restart()
                    except LighthouseFailed as exc:
                        logger.error(f"ft: {exc}")
                watch.check(set(pending.values()))
            live.tick()
        return None
    except (KeyboardInterrupt, Stopped) as exc:
        name = exc.name if isinstance(exc, Stopped) else "SIGINT"
        say(f"{name}: stopping {len(pending)} replica group(s)")
        for k in pending.values():
            supervisors[k][0].cancel.remote()
        with stop_signals(True):
            try:
                rt.wait_all(list(pending), CANCEL_WAIT_S)
            except (KeyboardInterrupt, Stopped):
                pass  # asked again: stop waiting (the supervisors are killed)
        return name
    finally:
        live.close()
