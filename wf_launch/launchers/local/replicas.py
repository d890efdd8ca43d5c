"""``ft=torchft`` on the local launcher: one torch elastic agent per replica group.

Each replica group is a child process of the launcher (forked before the launcher runs any
thread) that runs the ordinary local launch (:func:`.launcher.launch`) of the engine layout in
the replica group's own run directory (``RUN_DIR/replicas/{k}``), with its own rendezvous
store and groups, and ``launcher.max_restarts = ft.max_replica_restarts``: a rank that dies
restarts only its replica group, while the others keep stepping with one replica group fewer.
The launcher starts and supervises torchft's Lighthouse (restarting it when it dies), tears down
a replica group that hangs (:mod:`..ft_hang`), forwards SIGTERM and Ctrl-C to the replica groups,
and writes the run's ``result.json`` with an ``ft`` section (:mod:`..ft_record`) once every
replica group has ended.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

from loguru import logger

from ...config.ft import FtConfig
from ...rank.ft import ENDED, FT_REPLICA_ENV, LIGHTHOUSE_ENV, RUST_LOG, append_event, write_mark
from ...rundir.outcome import RunOutcome
from ...rundir.pids import die_with_parent
from ..ft_hang import HangWatch
from ..ft_lighthouse import Lighthouse, LighthouseFailed
from ..ft_record import last_step
from ..ft_replicas import (
    lighthouse_failed,
    prepare_replica_dir,
    record_replicas,
    start_lighthouse,
)

if TYPE_CHECKING:
    from ..launch_plan import LaunchPlan

__all__ = ["launch_replicas", "replica_main"]

LaunchFn = Callable[..., RunOutcome]
POLL_S = 0.2


def _replica_plan(plan: LaunchPlan, k: int, ft: FtConfig) -> LaunchPlan:
    """Replica group ``k``'s plan: its run directory, its restarts, a free rendezvous port."""
    config = copy.deepcopy(plan.config)
    config["launcher"]["max_restarts"] = ft.max_replica_restarts
    config["launcher"]["rdzv_port"] = 0
    if not config["launcher"].get("threads_per_rank"):
        # the cores are shared by every replica group's ranks, not each group's alone
        ranks = ft.replicas * plan.world_size
        config["launcher"]["threads_per_rank"] = max(1, (os.cpu_count() or 1) // ranks)
    return replace(plan, config=config, run_dir=prepare_replica_dir(plan, k))


def replica_main(launch: LaunchFn, plan: LaunchPlan, k: int, lighthouse: str) -> None:
    """In replica group ``k``'s process (forked here, or a SLURM job step): the ordinary local
    launch, its failures recorded; never returns."""
    os.setpgid(0, 0)  # Ctrl-C at the terminal reaches the launcher, which forwards it once
    die_with_parent(signal.SIGTERM)  # the agent then stops its ranks
    os.environ[FT_REPLICA_ENV] = str(k)
    os.environ[LIGHTHOUSE_ENV] = lighthouse
    os.environ.setdefault(RUST_LOG, "warn")

    def on_restart(n: int, exit_codes: dict[int, int]) -> None:
        append_event(
            plan.run_dir,
            event="failed",
            attempt=n,
            exit_codes={str(r): c for r, c in exit_codes.items()},
            failed_at_step=last_step(plan.run_dir),
        )
        logger.warning(f"ft: replica group {k} failed (ranks {sorted(exit_codes)}); restarting it")

    try:
        outcome = launch(plan, on_restart=on_restart)
        code = outcome.exit_code
    except BaseException as exc:
        logger.error(f"ft: replica group {k}'s launch failed: {type(exc).__name__}: {exc}")
        code = 1
    write_mark(plan.run_dir, ENDED)  # the others stop waiting for it
    logger.complete()
    os._exit(code)


class _Signals:
    """SIGTERM and Ctrl-C reach the launcher: remembered, and forwarded to every replica group."""

    def __init__(self, procs: dict[int, Any]) -> None:
        self.procs, self.name = procs, None
        self.old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in self.old:
            signal.signal(s, self._on)

    def _on(self, signum: int, _frame: Any) -> None:
        self.name = self.name or signal.Signals(signum).name
        for proc in self.procs.values():
            if proc.is_alive() and proc.pid:
                try:
                    os.kill(proc.pid, signum)
                except ProcessLookupError:
                    pass

    def restore(self) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)


def _supervise(procs: dict[int, Any], lighthouse: Lighthouse | None, watch: HangWatch) -> None:
    """Wait for every replica group; restart the Lighthouse whenever it dies meanwhile, and tear
    down a group the hang watch finds hung."""
    while any(p.is_alive() for p in procs.values()):
        wait([p.sentinel for p in procs.values() if p.is_alive()], timeout=POLL_S)
        if lighthouse is not None and not lighthouse.alive() and _any_alive(procs):
            try:
                lighthouse.restart()
            except LighthouseFailed as exc:
                logger.error(f"ft: {exc}")
        watch.check({k for k, p in procs.items() if p.is_alive()})


def _any_alive(procs: dict[int, Any]) -> bool:
    return any(p.is_alive() for p in procs.values())


def launch_replicas(plan: LaunchPlan, launch: LaunchFn) -> RunOutcome:
    """Start the Lighthouse (unless one runs) and every replica group; wait; record the run."""
    ft = FtConfig.from_dict(plan.config["ft"])
    t0 = time.time()
    try:
        lighthouse, address = start_lighthouse(plan, ft)
    except LighthouseFailed as exc:
        return lighthouse_failed(plan, str(exc))
    logger.info(
        f"ft: {ft.replicas} replica group(s) of {plan.layout.describe()}, min_replicas "
        f"{ft.min_replicas}, task={plan.task}, run dir {plan.run_dir}"
    )
    fork = multiprocessing.get_context("fork")
    procs: dict[int, Any] = {}
    signals = _Signals(procs)
    try:
        for k in range(ft.replicas):
            plan_k = _replica_plan(plan, k, ft)
            procs[k] = fork.Process(
                target=replica_main, args=(launch, plan_k, k, address), name=f"wf-replica{k}"
            )
            procs[k].start()
        watch = HangWatch(plan.run_dir, ft.replicas, plan.world_size, ft.hang_after_s)
        _supervise(procs, lighthouse, watch)
    finally:
        signals.restore()
        for p in procs.values():
            p.join()
        if lighthouse is not None:
            lighthouse.stop()
    codes = {k: p.exitcode for k, p in procs.items()}
    restarts = len(lighthouse.restarts) if lighthouse is not None else 0
    return record_replicas(plan, ft, codes, restarts, signals.name, time.time() - t0)
