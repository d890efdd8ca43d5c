"""Preemption in a rank: the scheduler's warning signal, the ``on_preempt`` hook, the requeue.

``RankSpec.preempt`` is the launcher's policy: any picklable object with ``signal``
(e.g. 'USR2'), ``wait_s``, ``restart()`` (this run's restart count), ``allowed()`` and
``requeue()`` (SLURM's is :class:`~wf_launch.launchers.slurm.rank_entry.SlurmRequeue`).
A task that polls ``ctx.should_stop()`` only gets its stop flag set; otherwise every
rank runs the task's ``on_preempt(ctx)`` hook and rank 0 requeues once every rank has
recorded its hook. Without a policy, SIGTERM sets the stop flag of a polling task and
keeps its default action otherwise.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..rundir import files
from ..rundir.io import atomic_write_json, read_json

__all__ = ["PreemptHandler", "Preempted", "requeue_after_stop", "stop_on_sigterm"]


class Preempted(BaseException):
    """This rank stops because the job goes back to the queue (not a failure)."""


def _marker(run_dir: Path | str, rank: int, **fields: Any) -> None:
    atomic_write_json(
        files.rank_preempt(run_dir, rank),
        {
            "rank": rank,
            **fields,
            "time": time.time(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        },
    )


class PreemptHandler:
    """On ``policy.signal``: run the task's ``on_preempt(ctx)`` on this rank, record it, and, if
    ``policy.allowed()``, let rank 0 requeue once every rank has recorded its hook (or
    ``policy.wait_s`` passed); then every rank raises :class:`Preempted`. With no requeue left
    the task goes on until the time limit ends it."""

    def __init__(
        self, policy: Any, run_dir: Path | str, rank: int, world_size: int, log: Any
    ) -> None:
        self.policy, self.run_dir, self.rank, self.world_size, self.log = (
            policy,
            run_dir,
            rank,
            world_size,
            log,
        )
        self.task: Any = None
        self.ctx: Any = None
        self.busy = False
        signal.signal(getattr(signal, f"SIG{policy.signal}"), self)

    def __call__(self, signum: int, frame: Any) -> None:
        stop = getattr(self.ctx, "stop", None)
        if stop is not None and stop.polled:
            # The task polls ctx.should_stop(): the signal only sets the flag; the task saves at its
            # next step boundary and returns, and the entrypoint requeues afterwards.
            stop.request(signal.Signals(signum).name)
            return
        if self.busy:
            return
        self.busy = True
        restart = self.policy.restart()
        self.log.warning(
            f"rank {self.rank}: {signal.Signals(signum).name} (preemption / time limit)"
        )
        outcome = self._run_hook()
        requeue = self.policy.allowed()
        _marker(self.run_dir, self.rank, restart=restart, hook=outcome, requeue=requeue)
        if not requeue:
            self.log.warning("no requeue left: the task goes on until the time limit")
            self.busy = False
            return
        if self.rank == 0:
            self._wait_for_peers(restart)
            self.log.warning("requeueing the job")
            self.policy.requeue()
        raise Preempted(f"rank {self.rank}: job requeued after restart {restart}")

    def _run_hook(self) -> str:
        hook = getattr(self.task, "on_preempt", None)
        if hook is None:
            return "no hook"
        if self.ctx is None:
            return "not started"
        try:
            hook(self.ctx)
            return "ok"
        except Exception as exc:
            self.log.opt(exception=exc).error(f"on_preempt hook failed: {exc}")
            return f"error: {type(exc).__name__}: {exc}"

    def _wait_for_peers(self, restart: int) -> None:
        deadline = time.monotonic() + self.policy.wait_s
        while time.monotonic() < deadline:
            done = [
                (read_json(files.rank_preempt(self.run_dir, r)) or {}).get("restart")
                for r in range(self.world_size)
            ]
            if all(d == restart for d in done):
                return
            time.sleep(0.1)


def stop_on_sigterm(ctx: Any, preempting: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM to a rank: a stop request once the task polls ``ctx.should_stop()``, else the
    default; ignored while ``preempting()`` (the job is being requeued: the rank leaves on its
    own)."""

    def handler(signum: int, frame: Any) -> None:
        if ctx.stop is not None and ctx.stop.polled:
            ctx.stop.request("SIGTERM")
            return
        if preempting():
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, handler)


def requeue_after_stop(
    policy: Any,
    run_dir: Path | str,
    ctx: Any,
    rank: int,
    log: Any,
    barrier: Callable[[], None] | None = None,
) -> None:
    """Every rank agreed to stop (the task saved and returned): rank 0 requeues the job, all leave
    quietly.

    ``barrier`` (default: the world group's) returns on rank 0 once every rank got this far.
    """
    restart = policy.restart()
    _marker(
        run_dir,
        rank,
        restart=restart,
        hook="stop flag",
        requeue=True,
        signal_at=ctx.stop.requested_at,
    )
    (barrier or ctx.groups["world"].barrier)()
    if rank == 0:
        log.warning("every rank stopped at the same step: requeueing the job")
        policy.requeue()
    raise Preempted(f"rank {rank}: job requeued after restart {restart} (stop flag)")
