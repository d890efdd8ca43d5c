"""torch elastic's agent, run the way ``elastic_launch`` runs it, keeping every rank's exit code.

``elastic_launch`` reports only the first failed worker it notices. When a rank is
killed by a signal and a peer exits an instant later because it lost that rank,
the peer can be the one reported. This agent snapshots every worker's exit code at
the moment the failure is seen (before the agent stops the survivors), so the
launcher can name the rank that was killed and the signal that killed it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed.elastic.rendezvous.registry as rdzv_registry
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.launcher.api import LaunchConfig

__all__ = ["RanksFailed", "run_agent"]


class _ExitCodeAgent(LocalElasticAgent):
    """A LocalElasticAgent that remembers each global rank's exit code when a failure is seen."""

    exit_codes: dict[int, int]

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.is_failed():
            codes = _exit_codes(self._pcontext)
            self.exit_codes = {w.global_rank: codes[w.local_rank] for w in worker_group.workers
                               if codes.get(w.local_rank) not in (None, 0)}
        return result


def _exit_codes(pcontext: Any) -> dict[int, int | None]:
    """Exit code (None while running) of each local rank, for function and command workers."""
    pc = getattr(pcontext, "_pc", None)
    if pc is not None:
        return {i: p.exitcode for i, p in enumerate(pc.processes)}
    handlers = getattr(pcontext, "subprocess_handlers", None) or {}
    return {i: h.proc.poll() for i, h in handlers.items()}


class RanksFailed(Exception):
    """The ranks failed: ``exit_codes`` maps each failed global rank to its exit code (< 0: signal)."""

    def __init__(self, exit_codes: dict[int, int], error: ChildFailedError) -> None:
        super().__init__(str(error))
        self.exit_codes = exit_codes


def run_agent(config: LaunchConfig, entrypoint: Callable[..., Any], *args: Any) -> dict[int, Any]:
    """Start ``entrypoint(*args)`` on every rank of ``config`` and wait; returns rank -> return value.

    Raises :class:`RanksFailed` when workers fail, and lets the agent's
    ``SignalException`` through when the launcher itself is signalled (after the
    agent has stopped every worker).
    """
    params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint,
                                  run_id=config.run_id, min_nodes=config.min_nodes,
                                  max_nodes=config.max_nodes, local_addr=config.local_addr,
                                  **config.rdzv_configs)
    spec = WorkerSpec(role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
                      args=tuple(args), rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
                      max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
                      local_addr=config.local_addr)
    agent = _ExitCodeAgent(spec=spec, logs_specs=config.logs_specs, start_method=config.start_method,
                           shutdown_timeout=config.shutdown_timeout)
    agent.exit_codes = {}
    try:
        result = agent.run()
    except SignalException:
        raise  # as elastic_launch does: a signalled agent leaves the rendezvous open
    except BaseException:
        spec.rdzv_handler.shutdown()
        raise
    spec.rdzv_handler.shutdown()
    if result.is_failed():
        error = ChildFailedError(name=getattr(entrypoint, "__name__", "rank"), failures=result.failures)
        codes = dict(agent.exit_codes)
        for rank, failure in result.failures.items():
            codes.setdefault(rank, failure.exitcode)
        raise RanksFailed(codes, error)
    return result.return_values
