"""torch elastic's agent, run the way ``elastic_launch`` runs it, keeping every rank's exit code.

``elastic_launch`` reports only the first failed worker it notices. When a rank is
killed by a signal and a peer exits an instant later because it lost that rank,
the peer can be the one reported. This agent snapshots every worker's exit code at
the moment the failure is seen (before the agent stops the survivors), so the
launcher can name the rank that was killed and the signal that killed it.

With ``fork`` it also holds every forked worker at a :class:`ForkGate` until the
agent has forked them all (see there).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.elastic.rendezvous.registry as rdzv_registry
from loguru import logger
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)
from torch.distributed.launcher.api import LaunchConfig

from worldfoundry.core.distributed.runtime import bound_store
from worldfoundry.core.torch_private import (
    hooked_agent_class,
    kill_at_once_on_failure,
    release_finished_workers,
    store_server_handler_class,
    worker_exit_codes,
    worker_pids,
)

from ...observe.stacks import describe_groups, group_spots, rank_ranges, spot_of
from ...observe.watch import PEERS_GRACE_S, a_collective_timed_out
from ..base import CTRL_C_NOTICE
from ..interrupt import STRAGGLER_GRACE_S
from .rank_entry import HELD_AT_FORK

__all__ = [
    "LOOPBACK",
    "STRAGGLER_GRACE_S",
    "ForkGate",
    "PortInUse",
    "RanksFailed",
    "Stragglers",
    "loopback_store",
    "run_agent",
]

LOOPBACK = "127.0.0.1"
_AGENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""The signals torch's worker context handles while the ranks run
(``TORCHELASTIC_SIGNALS_TO_HANDLE``)."""


class PortInUse(OSError):
    """The launch's own rendezvous port is taken: a launch never joins another process's store."""

    def __init__(self, port: int, why: str) -> None:
        super().__init__(
            f"launcher.rdzv_port={port}: port {port} is in use on {LOOPBACK} ({why}); "
            "choose another port, or 0 for a free one"
        )
        self.port = port


def loopback_store(port: int, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server that listens on 127.0.0.1 only; a busy ``port`` is :class:`PortInUse`
    (not torch's silent fallback to joining whatever listens there as a client)."""
    try:
        return bound_store(LOOPBACK, port, timedelta(seconds=timeout_s))
    except OSError as exc:
        raise PortInUse(port, exc.strerror or str(exc)) from None


def _loopback_handler(params: RendezvousParameters, port: int) -> DynamicRendezvousHandler:
    """torch's c10d rendezvous, with both stores (the rendezvous' and the one the workers share) on
    loopback."""
    read_timeout = float(params.get_as_int("read_timeout", 60) or 60)
    store = loopback_store(port, read_timeout)
    backend = C10dRendezvousBackend(store, params.run_id)
    join = params.get_as_int("join_timeout", params.get_as_int("timeout", 600))
    handler = store_server_handler_class().from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        LOOPBACK,
        RendezvousTimeout(join=timedelta(seconds=join or 600)),
    )
    handler.store_factory = lambda master_port: loopback_store(master_port, read_timeout)
    return handler


class ForkGate:
    """Holds forked workers at their start until the agent has forked every one of them.

    The agent forks workers from a process that runs threads: the rendezvous
    stores' libuv server threads call ``getnameinfo()`` for each connection a
    started worker makes, holding glibc's resolver lock for that moment. A worker
    forked in that moment inherits the lock held, and its own first
    ``getnameinfo()`` (the TCPStore connect in ``dist_init``) blocks forever. With
    the gate no worker connects to anything while the agent is still forking.

    Cost: the workers' start-up no longer overlaps the forks, and all of them
    connect at once; the store's server thread does one reverse-DNS lookup per
    connection (a dropped query costs glibc's 5 s resolver timeout for everyone).
    """

    def __init__(self) -> None:
        self._fds: tuple[int, int] | None = None

    def arm(self) -> None:
        """In the agent, before it forks the workers."""
        self._fds = os.pipe()

    def release(self, workers: int) -> None:
        """In the agent, once every worker is forked: let them all go."""
        if self._fds is None:
            return
        r, w = self._fds
        self._fds = None
        try:
            os.write(w, b"\0" * workers)
        finally:
            os.close(w)
            os.close(r)

    def wait(self) -> None:
        """In a forked worker: block until the agent has forked every worker (or died)."""
        if self._fds is None:
            return
        r, w = self._fds
        self._fds = None
        os.close(w)
        os.read(r, 1)
        os.close(r)


class _ExitCodeAgent(hooked_agent_class()):  # type: ignore[misc]
    """torch's local agent that remembers the exit code of each global rank that failed on its
    own: those that had failed when the failure was first seen, before torch stopped the others
    (all that failed, when the check missed that moment)."""

    exit_codes: dict[int, int]
    gate: ForkGate | None = None
    watch: Any = None
    dumps: dict[int, Any] | None = None
    first_failed: dict[int, int] | None = None
    on_start: Callable[[int, dict[int, int]], None] | None = None
    starts: int = 0
    group: WorkerGroup | None = None
    kill_survivors: bool = False

    def start_workers(
        self, worker_group: WorkerGroup, start: Callable[[], dict[int, Any]]
    ) -> dict[int, Any]:
        if self.on_start is not None:
            self.on_start(
                self.starts, dict(self.exit_codes)
            )  # the previous start's failed ranks, if any
        self.starts += 1
        self.group = worker_group
        self.exit_codes = {}
        self.first_failed = None
        self.dumps = None
        if self.watch is not None:
            self.watch.restart()
        held = HELD_AT_FORK if self.start_method == "fork" else {signal.SIGINT}
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            if self.gate is None or self.start_method != "fork":
                return self._started(start())
            self.gate.arm()
            try:
                return self._started(start())
            finally:
                self.gate.release(len(worker_group.workers))
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)

    def _started(self, workers: dict[int, Any]) -> dict[int, Any]:
        """With ``kill_survivors`` (a replica group's ranks, which restart whole and heal): once a
        rank fails, torch kills the others at once. Its default is SIGTERM and up to 30 s before
        a SIGKILL, and a rank blocked in native code (a gloo collective, torchft's quorum call)
        runs no Python signal handler until that returns: the group would come back 30 s late,
        its peers waiting for it meanwhile."""
        if self.kill_survivors:
            kill_at_once_on_failure(self.process_context)
        return workers

    def stop_signal(self, death_sig: Any) -> Any:
        """Ctrl-C (SIGINT) stops the ranks the graceful way, as SIGTERM does: through the stop flag,
        so a task that polls ``ctx.should_stop()`` saves and returns; a second Ctrl-C stops them at
        once."""
        if death_sig == signal.SIGINT:
            logger.warning(CTRL_C_NOTICE)
            return signal.SIGTERM
        return death_sig

    def on_signalled(self, death_sig: Any) -> None:
        """The launcher was signalled: ranks that have not stopped :data:`STRAGGLER_GRACE_S`
        later are shown where they are (grouped stacks), before the agent kills them."""
        if self.watch is None or self.process_context is None or self.group is None:
            return
        pids = self._live_pids(self.group)
        if pids:
            Stragglers(self.watch, pids, signal.Signals(death_sig).name).start()

    def on_shutdown(self) -> None:
        # The launcher was signalled: its SIGTERM reaches the ranks, a task that polls the stop flag
        # saves
        # and returns, and its rank then waits for the agent to collect its return value, which a
        # stopping
        # agent never does. Let those ranks exit at once instead of at the end of the shutdown
        # timeout.
        release_finished_workers(self.process_context)

    def _live_pids(self, worker_group: WorkerGroup) -> dict[int, int]:
        """Global rank -> pid of every worker still running."""
        codes = worker_exit_codes(self.process_context)
        pids = worker_pids(self.process_context)
        return {
            w.global_rank: pids[w.local_rank]
            for w in worker_group.workers
            if w.local_rank in pids and codes.get(w.local_rank) is None
        }

    def before_monitor(self, worker_group: WorkerGroup) -> None:
        if self.process_context is None or self.first_failed is not None:
            return
        failed = self._failed(worker_group)
        if not failed:
            return
        # Before torch stops the survivors (SIGTERM, then SIGKILL after the shutdown timeout, so
        # their codes can look like a kill -9): the ranks that failed on their own.
        self.first_failed = failed
        if self.watch is not None and self.dumps is None:  # where is everyone?
            if a_collective_timed_out(self.watch.run_dir):
                self._let_peers_end(worker_group)
            self.dumps = self.watch.autopsy(
                self._live_pids(worker_group),
                alive=lambda rank: rank in self._live_pids(worker_group),
            )

    def _failed(self, worker_group: WorkerGroup) -> dict[int, int]:
        """Global rank -> exit code of every rank that ended badly."""
        codes = worker_exit_codes(self.process_context)
        return {
            w.global_rank: code
            for w in worker_group.workers
            if (code := codes.get(w.local_rank)) not in (None, 0)
        }

    def _failed_unseen(self, worker_group: WorkerGroup, result: RunResult) -> dict[int, int]:
        """The failed ranks when :meth:`before_monitor` missed the moment. With ``kill_survivors``
        torch's own check SIGKILLed the survivors in the same call: a rank killed so is not named
        unless that check named it."""
        failed = self._failed(worker_group)
        if not self.kill_survivors:
            return failed
        return {
            rank: code
            for rank, code in failed.items()
            if rank in result.failures or code != -signal.SIGKILL
        }

    def _let_peers_end(self, worker_group: WorkerGroup) -> None:
        """Wait up to :data:`PEERS_GRACE_S` for the live ranks to end on their own."""
        deadline = time.monotonic() + PEERS_GRACE_S
        while self._live_pids(worker_group) and time.monotonic() < deadline:
            time.sleep(0.05)

    def after_monitor(self, worker_group: WorkerGroup, result: RunResult) -> RunResult:
        if result.is_failed():
            self.exit_codes = self.first_failed or self._failed_unseen(worker_group, result)
        elif self.watch is not None and self.process_context is not None:
            self.watch.tick(self._live_pids(worker_group))
        return result


class Stragglers(threading.Thread):
    """After a SIGTERM or Ctrl-C: the ranks still running :data:`STRAGGLER_GRACE_S` later, shown
    where they are (a task that never polls the stop flag, a script stuck in a call)."""

    def __init__(self, watch: Any, pids: dict[int, int], signal_name: str) -> None:
        super().__init__(name="wf-stragglers", daemon=True)
        self.watch, self.pids = watch, pids
        self.why = "Ctrl-C" if signal_name == "SIGINT" else signal_name

    def run(self) -> None:
        deadline = time.monotonic() + STRAGGLER_GRACE_S
        while time.monotonic() < deadline and any(map(_running, self.pids.values())):
            time.sleep(0.1)
        left = {r: p for r, p in self.pids.items() if _running(p)}
        if not left:
            return
        dumps = self.watch.autopsy(left, alive=lambda rank: _running(left[rank]))
        spots = {r: spot_of(frames) for r, frames in dumps.items()}
        logger.warning(
            f"{len(left)} rank(s) still running {STRAGGLER_GRACE_S:g} s after the {self.why}; "
            "where they are (they are killed at launcher.shutdown_timeout_s, or at a second "
            "Ctrl-C):"
        )
        for line in describe_groups(group_spots(spots), self.watch.label_of):
            logger.warning(line)
        silent = sorted(set(left) - set(spots))
        if silent:
            logger.warning(f"  ranks {rank_ranges(silent)} gave no stack dump")


def _running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:  # the kernel's, not a run file
            stat = f.read()
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


class RanksFailed(Exception):
    """The ranks failed: ``exit_codes`` maps each global rank that failed on its own to its exit
    code (< 0: signal); ``dumps`` the stacks of the ranks still alive when the failure was seen."""

    def __init__(
        self,
        exit_codes: dict[int, int],
        error: ChildFailedError,
        dumps: dict[int, Any] | None = None,
    ) -> None:
        super().__init__(str(error))
        self.exit_codes = exit_codes
        self.dumps = dumps or {}


def run_agent(
    config: LaunchConfig,
    entrypoint: Callable[..., Any],
    *args: Any,
    loopback_only: bool = True,
    gate: ForkGate | None = None,
    watch: Any = None,
    on_start: Callable[[int, dict[int, int]], None] | None = None,
    kill_survivors: bool = False,
) -> dict[int, Any]:
    """Start ``entrypoint(*args)`` on every rank of ``config`` and wait; returns rank -> return
    value.

    With ``loopback_only`` (a single host), the rendezvous store and the store
    the ranks share listen on 127.0.0.1 only, on ports this launch owns. With
    ``fork``, ``gate`` (if given, and passed to the entrypoint among ``args``) is
    armed around each start of the workers; the entrypoint calls ``gate.wait()`` first.
    ``watch`` (a :class:`~wf_launch.observe.watch.RankWatch`) is ticked between checks of
    the workers and asked for stacks when one fails. ``on_start(n, exit_codes)`` is called
    before the workers' ``n``-th start (0 first, then once per restart) with the failed
    ranks' exit codes of the start before it. ``kill_survivors``: once a rank fails, SIGKILL the
    others at once (an ft replica group's, which restarts whole and heals) instead of torch's
    SIGTERM and up to 30 s.

    Raises :class:`RanksFailed` when workers fail, and lets the agent's
    ``SignalException`` through when the launcher itself is signalled (after the
    agent has stopped every worker).
    """
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    if loopback_only:
        handler = _loopback_handler(params, int(config.rdzv_endpoint.rpartition(":")[2] or 0))
    else:
        handler = rdzv_registry.get_rendezvous_handler(params)
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
    )
    agent = _ExitCodeAgent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        # LaunchConfig and the agent took shutdown_timeout in the same torch release (2.12)
        **(
            {"shutdown_timeout": config.shutdown_timeout}
            if hasattr(config, "shutdown_timeout")
            else {}
        ),
    )
    agent.exit_codes = {}
    agent.gate = gate
    agent.watch = watch
    agent.on_start = on_start
    agent.kill_survivors = kill_survivors
    handlers = {s: signal.getsignal(s) for s in _AGENT_SIGNALS}
    try:
        result = agent.run()
    except SignalException:
        raise  # as elastic_launch does: a signalled agent leaves the rendezvous open
    except BaseException:
        spec.rdzv_handler.shutdown()
        raise
    finally:
        # torch's handlers raise; after the ranks, Ctrl-C is ours again
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    spec.rdzv_handler.shutdown()
    if result.is_failed():
        error = ChildFailedError(
            name=getattr(entrypoint, "__name__", "rank"), failures=result.failures
        )
        codes = dict(agent.exit_codes)
        for rank, failure in result.failures.items():
            codes.setdefault(rank, failure.exitcode)
        raise RanksFailed(codes, error, agent.dumps)
    return result.return_values
