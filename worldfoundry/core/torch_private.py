"""Every private torch name this project relies on, in one place.

torch gives no public way to do a few things the launcher and the runtime need:
hook the elastic agent's worker start, shutdown and monitoring (every rank's exit
code, a fork gate, the stack autopsy), bind the rendezvous store to loopback, read
the worker processes' exit codes and pids, reuse CPU staging buffers for async
checkpoints, wait on an async functional-collective tensor, abort every process
group, and the fused ``_foreach`` ops of the EMA. Nothing else in ``wf_launch`` or
``worldfoundry`` touches a private torch name (``tests/test_architecture.py``
checks), and nothing here falls back silently: :func:`check_names` lists what a
torch upgrade removed or renamed, and ``tests/test_upstream_names.py`` fails on it
with that list (as ``submitit_adapter`` does for submitit).

The elastic classes are built on first use (:func:`hooked_agent_class`,
:func:`store_server_handler_class`), so importing this module costs only ``torch``.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import signal
import sys
from collections.abc import Callable
from functools import lru_cache, partial
from typing import Any

import torch

__all__ = [
    "DCP_METADATA_PRIVATE",
    "DYNAMO_MODULE",
    "PRIVATE_NAMES",
    "abort_all_process_groups",
    "check_names",
    "copy_state_dict",
    "create_cpu_state_dict",
    "foreach_add_",
    "foreach_copy_",
    "foreach_lerp_",
    "foreach_mul_",
    "hooked_agent_class",
    "kill_at_once_on_failure",
    "release_finished_workers",
    "set_default_group_timeout",
    "store_server_handler_class",
    "wait_async_collective",
    "worker_exit_codes",
    "worker_pids",
]

_AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent"
_MP_API = "torch.distributed.elastic.multiprocessing.api"
_RDZV = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"

# (module, name, kind, what we need it for). kind: "attr" resolves as an attribute path;
# "self" is an instance attribute the class's source assigns (``self.NAME =``); "module" is a
# module.
PRIVATE_NAMES: tuple[tuple[str, str, str, str], ...] = (
    (
        _AGENT,
        "LocalElasticAgent._start_workers",
        "attr",
        "fork gate, attempt records, restart of the watch",
    ),
    (
        _AGENT,
        "LocalElasticAgent._shutdown",
        "attr",
        "release ranks that finished when the launcher is signalled",
    ),
    (
        _AGENT,
        "LocalElasticAgent._monitor_workers",
        "attr",
        "every rank's exit code, the stack autopsy",
    ),
    (_AGENT, "LocalElasticAgent._pcontext", "self", "the worker processes"),
    (_AGENT, "LocalElasticAgent._start_method", "self", "the fork gate only holds forked workers"),
    (_MP_API, "MultiprocessContext._pc", "self", "exit codes of function workers"),
    (
        _MP_API,
        "MultiprocessContext._worker_finished_event",
        "self",
        "ranks waiting to hand back their value",
    ),
    (_MP_API, "SubprocessContext.subprocess_handlers", "self", "exit codes of command workers"),
    (
        "multiprocessing.synchronize",
        "Event._cond",
        "self",
        "set the finished event without blocking",
    ),
    (
        _RDZV,
        "DynamicRendezvousHandler._create_tcp_store_server",
        "attr",
        "the rendezvous store on loopback only",
    ),
    (
        _RDZV,
        "DynamicRendezvousHandler._shared_tcp_store_server",
        "self",
        "a fresh worker store for every restart",
    ),
    (
        _RDZV,
        "DynamicRendezvousHandler._bootstrap_store_info",
        "self",
        "a fresh worker store for every restart",
    ),
    (
        "torch.distributed._state_dict_utils",
        "_copy_state_dict",
        "attr",
        "async checkpoints: reuse CPU buffers",
    ),
    (
        "torch.distributed._state_dict_utils",
        "_create_cpu_state_dict",
        "attr",
        "async checkpoints: CPU buffers",
    ),
    (
        "torch.distributed.checkpoint.filesystem",
        "_StorageInfo",
        "attr",
        "checkpoint metadata: admitted class",
    ),
    (
        "torch.distributed.checkpoint.metadata",
        "_MEM_FORMAT_ENCODING",
        "attr",
        "checkpoint metadata: admitted class",
    ),
    (
        "torch.serialization",
        "_get_layout",
        "attr",
        "checkpoint metadata: admitted (a tensor layout by name)",
    ),
    (
        "torch.distributed._functional_collectives",
        "AsyncCollectiveTensor",
        "attr",
        "a DTensor's pending shard",
    ),
    (
        "torch.distributed.distributed_c10d",
        "_abort_process_group",
        "attr",
        "abort every group at once",
    ),
    (
        "torch._dynamo",
        "",
        "module",
        "FSDP2's compiler, imported before the local launcher forks (preload)",
    ),
    (
        "torch.distributed.distributed_c10d",
        "default_pg_timeout",
        "attr",
        "the default timeout of groups a script makes (engine.distributed_timeout_minutes)",
    ),
    (
        "torch.distributed.distributed_c10d",
        "default_pg_nccl_timeout",
        "attr",
        "the default timeout of NCCL groups a script makes",
    ),
    ("torch", "_foreach_copy_", "attr", "EMA: fused copies"),
    ("torch", "_foreach_lerp_", "attr", "EMA: fused average"),
    ("torch", "_foreach_mul_", "attr", "EMA: fused average of mixed dtypes"),
    ("torch", "_foreach_add_", "attr", "EMA: fused average of mixed dtypes"),
)


def _resolve(module: str, dotted: str) -> Any:
    return pkgutil.resolve_name(f"{module}:{dotted}")


def check_names() -> list[str]:
    """What this project needs from torch's private API and no longer finds (empty: all there)."""
    problems: list[str] = []
    for module, name, kind, why in PRIVATE_NAMES:
        try:
            if kind == "module":
                importlib.import_module(module)
                continue
            if kind == "attr":
                _resolve(module, name)
                continue
            cls_name, _, attr = name.rpartition(".")
            source = inspect.getsource(_resolve(module, cls_name))
            if f"self.{attr} =" not in source and f"self.{attr}:" not in source:
                problems.append(
                    f"{module}.{name} ({why}): {cls_name} no longer assigns self.{attr}"
                )
        except (ImportError, AttributeError, OSError, TypeError) as exc:
            problems.append(f"{module}.{name} ({why}): {type(exc).__name__}: {exc}")
    return problems


def set_default_group_timeout(minutes: float) -> None:
    """The timeout of every process group made from now on without one of its own
    (``init_process_group``, ``new_group``, for every backend).

    torch reads its default from two module globals of ``distributed_c10d`` each time a group
    is made; there is no public setter.
    """
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    timeout = timedelta(minutes=minutes)
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout


# ------------------------------------------------------------------ the elastic agent
@lru_cache(maxsize=1)
def hooked_agent_class() -> type:
    """torch's ``LocalElasticAgent`` with public hooks where wf_launch needs its private methods.

    Subclasses override :meth:`start_workers` (wraps one start of the workers; call
    ``start()`` to start them), :meth:`on_shutdown` (before the agent stops its workers),
    :meth:`on_signalled` (then, when the agent itself was signalled: the signal),
    :meth:`stop_signal` (the signal the workers are stopped with, given the one the agent got)
    and :meth:`after_monitor` (sees each check of the workers and may replace its result).
    A second signal while the workers stop kills them at once.
    """
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class HookedLocalElasticAgent(LocalElasticAgent):
        def start_workers(
            self, worker_group: Any, start: Callable[[], dict[int, Any]]
        ) -> dict[int, Any]:
            return start()

        def on_shutdown(self) -> None:
            pass

        def on_signalled(self, death_sig: Any) -> None:
            pass

        def before_monitor(self, worker_group: Any) -> None:
            pass

        def after_monitor(self, worker_group: Any, result: Any) -> Any:
            return result

        def _start_workers(self, worker_group: Any) -> dict[int, Any]:
            return self.start_workers(
                worker_group, lambda: LocalElasticAgent._start_workers(self, worker_group)
            )

        def stop_signal(self, death_sig: Any) -> Any:
            return death_sig

        def _shutdown(self, death_sig: Any = None, *args: Any, **kwargs: Any) -> None:
            from torch.distributed.elastic.multiprocessing.api import SignalException

            self.on_shutdown()
            if death_sig is not None:
                self.on_signalled(death_sig)
            death_sig = self.stop_signal(signal.SIGTERM if death_sig is None else death_sig)
            try:
                LocalElasticAgent._shutdown(self, death_sig, *args, **kwargs)
            except SignalException:  # signalled again while the workers stop: stop them at once
                LocalElasticAgent._shutdown(self, signal.SIGKILL, timeout=5)
                raise

        def _monitor_workers(self, worker_group: Any) -> Any:
            self.before_monitor(worker_group)
            return self.after_monitor(
                worker_group, LocalElasticAgent._monitor_workers(self, worker_group)
            )

        @property
        def process_context(self) -> Any:
            """The agent's worker processes (None before the first start)."""
            return self._pcontext

        @property
        def start_method(self) -> str:
            """How the agent starts workers: 'fork', 'spawn' or 'forkserver'."""
            return self._start_method

    return HookedLocalElasticAgent


def worker_exit_codes(pcontext: Any) -> dict[int, int | None]:
    """Exit code (None while running) of each local rank, for function and command workers."""
    if pcontext is None:
        return {}
    if hasattr(pcontext, "subprocess_handlers"):
        return {i: h.proc.poll() for i, h in pcontext.subprocess_handlers.items()}
    return {i: p.exitcode for i, p in enumerate(pcontext._pc.processes)}


def kill_at_once_on_failure(pcontext: Any) -> None:
    """Once a function worker fails, kill the others at once: ``ProcessContext.join``'s grace
    period 0 (torch's check of the workers passes none: SIGTERM, then 30 s before SIGKILL).
    Command workers (``subprocess_handlers``) are left as they are."""
    pc = getattr(pcontext, "_pc", None)
    if pc is None or isinstance(pc.join, partial):
        return
    pc.join = partial(pc.join, grace_period=0)


def worker_pids(pcontext: Any) -> dict[int, int]:
    """Local rank -> pid of each worker process (public ``pids()``; empty before the first
    start)."""
    return pcontext.pids() if pcontext is not None else {}


def release_finished_workers(pcontext: Any, timeout_s: float = 1.0) -> None:
    """Let function workers that finished exit now: they wait for the agent to collect their value,
    which a stopping agent never does. A worker killed inside the event's wait may hold its lock:
    then nothing is done rather than block."""
    event = getattr(pcontext, "_worker_finished_event", None) if pcontext is not None else None
    if event is None:  # command workers, or workers not started yet: nothing waits on it
        return
    if event._cond.acquire(timeout=timeout_s):
        event._cond.release()
        event.set()


@lru_cache(maxsize=1)
def store_server_handler_class() -> type:
    """torch's ``DynamicRendezvousHandler`` whose store server comes from
    ``self.store_factory(port)``, a new one for every rendezvous round.

    torch shares one store server with the workers across rounds (``TORCHELASTIC_USE_AGENT_STORE``)
    and keeps its keys: after a restart, ``init_process_group`` of a plain torchrun script reads the
    previous attempt's gloo addresses when a peer re-joins late, and fails ("connectFullMesh ...
    Connection refused"; torchrun 2.13 itself does). A fresh server per round (a new port in
    ``MASTER_PORT``) holds only this attempt's keys.
    """
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    class StoreServerHandler(DynamicRendezvousHandler):
        store_factory: Callable[[int], Any] | None = None

        def _create_tcp_store_server(self, master_addr: str, master_port: int) -> Any:
            if self.store_factory is None:
                return DynamicRendezvousHandler._create_tcp_store_server(
                    self, master_addr, master_port
                )
            return self.store_factory(master_port)

        def next_rendezvous(self) -> Any:
            if (
                self.store_factory is not None
                and getattr(self, "_shared_tcp_store_server", None) is not None
            ):
                self._retired = getattr(
                    self, "_retired", []
                )  # kept alive: a late client never hits a dead socket
                self._retired.append(self._shared_tcp_store_server)
                self._shared_tcp_store_server = None
                self._bootstrap_store_info = None
            return DynamicRendezvousHandler.next_rendezvous(self)

    return StoreServerHandler


# ------------------------------------------------------------------ checkpoints, DTensor, groups
def create_cpu_state_dict(state_dict: dict[str, Any], pin_memory: bool = False) -> dict[str, Any]:
    """CPU buffers shaped like ``state_dict`` (DCP's staging helper)."""
    from torch.distributed._state_dict_utils import _create_cpu_state_dict

    return _create_cpu_state_dict(state_dict, pin_memory=pin_memory)


def copy_state_dict(state_dict: dict[str, Any], into: dict[str, Any]) -> dict[str, Any]:
    """Copy ``state_dict``'s tensors into the buffers of :func:`create_cpu_state_dict`."""
    from torch.distributed._state_dict_utils import _copy_state_dict

    return _copy_state_dict(state_dict, into)


DCP_METADATA_PRIVATE: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.serialization", "_get_layout"),
    }
)
"""The private (module, name) pairs a DCP ``.metadata`` pickle refers to: where each saved item
lies, a tensor's
memory format and its layout. The checkpoint reader's restricted unpickler admits these (and DCP's
public
metadata classes), nothing else; :func:`check_names` checks them on every torch upgrade."""


def wait_async_collective(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or its value once a pending functional collective (a DTensor shard)
    finished."""
    fc = sys.modules.get("torch.distributed._functional_collectives")
    if fc is not None and isinstance(tensor, fc.AsyncCollectiveTensor):
        return tensor.wait()
    return tensor


def abort_all_process_groups() -> bool:
    """Abort every process group without waiting on peers; False when this torch cannot."""
    import torch.distributed as dist

    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:  # torch < 2.5: the caller falls back to the world group's abort
        return False
    abort()
    return True


DYNAMO_MODULE = "torch._dynamo"
"""FSDP2's compiler module: a task preloads it (``register_task(preload=...)``) to spare every rank
the import."""

foreach_copy_ = torch._foreach_copy_
foreach_lerp_ = torch._foreach_lerp_
foreach_mul_ = torch._foreach_mul_
foreach_add_ = torch._foreach_add_
