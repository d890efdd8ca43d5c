"""The process's distributed runtime: every piece of state the library keeps, in one object.

:class:`Runtime` holds the world group object, the named model-parallel groups,
their layout, the process groups this library created (so they can be destroyed),
whether it owns the default group, the PP scheduler slot, the ``cp_size_t`` that
``find_split`` records, and a cache dict in which helpers keep per-runtime state
(e.g. ``broadcast_split_tensor``'s last headers). :meth:`Runtime.close` tears it
all down (on-close hooks first) and leaves the same object ready for the next
initialization. :func:`current` returns the process's runtime; the functions in
``groups`` / ``pipeline`` / ``context_parallel`` are thin wrappers over it.

The launch's rendezvous store is launch-scoped, not runtime-scoped: it is created
once per launch and re-used (with a fresh prefix) by every later initialization
of the default group (:func:`init_default_group`), so a process can close and
initialize again. The prefix also carries :func:`launch_attempt` (``WF_ATTEMPT``),
so a restarted attempt never reads an earlier attempt's keys.

Nothing here imports the helpers built on top (groups, CP, PP): they register
with the runtime, it never reaches up to them.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .env import ATTEMPT_ENV, launch_attempt
from .topology import Layout

__all__ = [
    "ATTEMPT_ENV",
    "LOCAL_STORE",
    "Runtime",
    "bound_store",
    "current",
    "init_default_group",
    "launch_attempt",
]


@dataclass(eq=False)
class Runtime:
    """Every piece of distributed state of this process (see the module docstring)."""

    world: Any = None
    """The world ``GroupCoordinator`` (None before ``init_distributed_environment``)."""
    layout: Layout | None = None
    """The model-parallel layout (None until ``initialize_model_parallel``)."""
    groups: dict[str, Any] = field(default_factory=dict)
    """Named ``GroupCoordinator`` objects: tp, cp, pp, dp, tp-cp, dp-cp, tp-pp."""
    created: list[Any] = field(default_factory=list)
    """Process groups this library created and this rank belongs to (destroyed by close)."""
    owns_world: bool = False
    """Whether this runtime initialized the default group (close then destroys it)."""
    pp_scheduler: Any = None
    """The process-wide PP scheduler slot (``pipeline.init_pp_scheduler`` fills it)."""
    pp_generation: int = 0
    """Schedulers created in this process; not reset by close, so scheduler tags never repeat."""
    cp_size_t: int | None = None
    """CP ranks the last ``find_split`` gave to the time axis."""
    cache: dict[str, Any] = field(default_factory=dict)
    """Per-runtime state of helpers, by key; cleared by close."""
    _on_close: list[Callable[[Runtime], None]] = field(default_factory=list, repr=False)

    def on_close(self, hook: Callable[[Runtime], None]) -> None:
        """Run ``hook(self)`` at the next :meth:`close` (once; hooks run newest first)."""
        self._on_close.append(hook)

    def destroy_created(self) -> None:
        """Destroy the process groups this runtime created (newest first), ignoring ones already
        gone."""
        settle_group_threads()
        for pg in reversed(self.created):
            try:
                dist.destroy_process_group(pg)
            except (RuntimeError, ValueError):
                pass
        self.created.clear()

    def close(self, destroy: bool = True) -> None:
        """Tear everything down: hooks, PP scheduler, caches, groups, ``cp_size_t``, the owned
        default group.

        ``destroy=False`` forgets the process groups without calling into
        torch.distributed (after an abort, when they are gone already). Safe to
        call when nothing is initialized; the object is reusable afterwards.
        """
        hooks, self._on_close = self._on_close, []
        for hook in reversed(hooks):
            hook(self)
        scheduler, self.pp_scheduler = self.pp_scheduler, None
        if scheduler is not None:
            scheduler.close()
        self.cache.clear()
        if destroy:
            self.destroy_created()
        self.created.clear()
        self.groups = {}
        self.layout = None
        self.cp_size_t = None
        if destroy and self.owns_world and dist.is_initialized():
            dist.destroy_process_group()  # destroy_created settled the group threads just before
        self.world = None
        self.owns_world = False


SETTLE_S = 0.01


def settle_group_threads() -> None:
    """Let gloo's worker threads finish with the last collectives before a process group is
    destroyed.

    ``ProcessGroupGloo``'s destructor joins its worker threads while the destroying thread holds
    the GIL. A worker that is still dropping a finished collective whose tensors only C++ holds
    (their Python objects were released when the call returned) must take the GIL to free them,
    and the two wait for each other forever: a rank stuck in ``~ProcessGroupGloo`` at the end of
    a run (seen about 1 run in 3 of the script drill under load). A short sleep gives the GIL
    away, so such a worker finishes first.
    """
    time.sleep(SETTLE_S)


_RUNTIME = Runtime()


def current() -> Runtime:
    """The process's runtime."""
    return _RUNTIME


# ---------------------------------------------------------------- the launch's rendezvous store


@dataclass
class _Rendezvous:
    """The launch's store, kept across destroy/init so the same process can re-initialize."""

    key: tuple[str, int, int] | None = None
    store: Any = None
    generation: int = 0


_RDZV = _Rendezvous()

JOIN_TIMEOUT = timedelta(minutes=5)
"""How long the launch's store waits for every rank to connect, unless told (``wf_launch``
passes ``engine.init_timeout_s``; its launcher bounds start-up with it too)."""

LOCAL_STORE = "wf-local://"
"""``init_method`` of a single process that no launcher started: an in-process store
(``HashStore``), so
nothing listens on any port (a TCP store on a free port would listen on every interface, and the
port
could be taken between picking and binding it)."""


def _is_loopback(host: str | None) -> bool:
    """Whether ``host`` is a loopback address written as one (``127.0.0.1``, ``::1``; not a
    name)."""
    import ipaddress

    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def _launch_store(
    init_method: str, rank: int, world_size: int, timeout: timedelta, join: timedelta
) -> Any:
    """The launch's store: in-process for :data:`LOCAL_STORE`; on rank 0 of an ``env://`` launch
    whose ``MASTER_ADDR`` is a loopback address, a server listening on that address only (torch's
    own listens on every interface); otherwise torch's rendezvous.

    Ranks may start ``join`` apart (a scheduler starts them one by one, a loaded machine imports
    torch slowly): the store waits that long for every rank to connect, then its own waits are
    bounded by ``timeout``, as the groups' collectives are."""
    if init_method == LOCAL_STORE:
        return dist.HashStore()
    master = os.environ.get("MASTER_ADDR")
    if (
        init_method == "env://"
        and rank == 0
        and _is_loopback(master)
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    ):
        store = _loopback_server(str(master), int(os.environ["MASTER_PORT"]), world_size, join)
    else:
        store, _, _ = next(dist.rendezvous(init_method, rank, world_size, timeout=join))
    store.set_timeout(timeout)
    return store


def _loopback_server(host: str, port: int, world_size: int, timeout: timedelta) -> Any:
    """A TCPStore server bound to ``host`` (a loopback address) alone; an error if the port is
    taken."""
    try:
        return bound_store(host, port, timeout, world_size)
    except OSError as exc:
        raise RuntimeError(
            f"the launch's store cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from None


def bound_store(
    host: str, port: int, timeout: timedelta, world_size: int | None = None
) -> dist.TCPStore:
    """A TCPStore server listening on ``host`` alone (torch's own listens on every interface).

    The socket is bound here and handed to the store (``master_listen_fd``), so a busy ``port``
    raises :class:`OSError` instead of torch's silent fallback to joining whatever listens
    there as a client. ``port=0`` takes a free port (``store.port``). With ``world_size``
    the store waits for that many clients, as torch's does.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(4096)
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(
        host,
        sock.getsockname()[1],
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=world_size is not None,
        multi_tenant=True,
        master_listen_fd=sock.detach(),
    )


_INHERITED_STORES: list[Any] = []


def _forget_store_after_fork() -> None:
    # A forked child must neither use nor destroy its parent's store (its destructor
    # would tear down the parent's server socket and abort): keep it, unused, forever.
    if _RDZV.store is not None:
        _INHERITED_STORES.append(_RDZV.store)
    _RDZV.key, _RDZV.store = None, None


os.register_at_fork(after_in_child=_forget_store_after_fork)


def init_default_group(
    backend: str,
    world_size: int = -1,
    rank: int = -1,
    init_method: str = "env://",
    timeout: timedelta | None = None,
    device_id: torch.device | None = None,
    join_timeout: timedelta | None = None,
) -> bool:
    """Initialize torch.distributed's default group unless it is up; True if this call did.

    The one path by which the library starts a default group (``dist_init``,
    ``init_distributed_environment`` and ``distributed_run`` all come here). With
    ``world_size`` and ``rank`` given, the launch's store is created once and
    re-used with a fresh prefix ``wf/attempt<WF_ATTEMPT>/init<n>/`` by every later
    call (:func:`_launch_store` makes it); otherwise ``init_method`` is handed to torch as it is.
    ``init_method=LOCAL_STORE`` is a single process's in-process store. The store waits
    ``join_timeout`` (default :data:`JOIN_TIMEOUT`; never less than ``timeout``) for every rank
    to connect.
    """
    if dist.is_initialized():
        return False
    if init_method == LOCAL_STORE:
        world_size, rank = 1, 0
    kwargs: dict[str, Any] = {"backend": backend}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if device_id is not None:
        kwargs["device_id"] = device_id
    if world_size >= 0 and rank >= 0:
        attempt = launch_attempt()  # a bad WF_ATTEMPT raises before any store is made
        # One store per launch, re-used with a fresh prefix by every later init: a
        # second init after destroy never races the first store's shutdown.
        key = (init_method, rank, world_size)
        if _RDZV.key != key:
            waits = timeout or timedelta(minutes=30)
            join = max(waits, join_timeout or JOIN_TIMEOUT)
            _RDZV.store = _launch_store(init_method, rank, world_size, waits, join)
            _RDZV.key = key
        _RDZV.generation += 1
        kwargs.update(
            store=dist.PrefixStore(f"wf/attempt{attempt}/init{_RDZV.generation}/", _RDZV.store),
            rank=rank,
            world_size=world_size,
        )
    else:
        kwargs["init_method"] = init_method
    dist.init_process_group(**kwargs)
    return True
