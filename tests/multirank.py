"""Run a function on N real, fork-started ranks of a gloo process group.

Tests call :func:`run_ranks`; each rank gets RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT in its environment, one torch thread, and (unless
``init=False``) an initialized gloo default group. Return values come back in rank
order; any rank's exception fails the call with every rank's traceback, and ranks
still alive at the deadline are killed, so a hang is a test failure, not a stuck
suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_CTX = mp.get_context("fork")


class RankFailure(AssertionError):
    """One or more ranks raised, or did not finish before the deadline."""

    def __init__(self, message: str, errors: dict[int, str]) -> None:
        super().__init__(message)
        self.errors = errors


RENDEZVOUS_PORTS = (3000, 6300)
"""Where ranks rendezvous: below the kernel's ephemeral range (32768-60999 here), which every
outgoing connection of the suite (gloo's own pairs included) draws from, so that none takes
the port between the moment it is chosen and the moment rank 0 binds it; apart from the test
clusters' ports (10000-20000) and the SLURM jobs' (20000-32000)."""


def free_port() -> int:
    """A TCP port on loopback, in :data:`RENDEZVOUS_PORTS`, that was free a moment ago."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(*RENDEZVOUS_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {RENDEZVOUS_PORTS}")


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    init: bool,
    env: dict[str, str],
    args: tuple,
    queue: Any,
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = None
        if init:
            store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timedelta(seconds=60))
            dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store)
        try:
            value = fn(rank, world_size, *args)
        finally:
            if store is not None:
                _leave_together(store, rank, world_size)
            if init and dist.is_initialized():
                dist.destroy_process_group()
        queue.put((rank, True, value))
    except BaseException as exc:  # report everything, SystemExit included
        queue.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)


def _leave_together(store: Any, rank: int, world_size: int, wait_s: float = 30.0) -> None:
    """Rank 0 hosts the store: it stays until every rank is done with it (a rank outside a
    ``new_group`` returns while its members still meet through the store), or ``wait_s``."""
    import time

    store.add(_DONE, 1)
    if rank != 0:
        return
    deadline = time.monotonic() + wait_s
    while store.add(_DONE, 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.01)


_DONE = "multirank/done"


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    init: bool = True,
    env: dict[str, str] | None = None,
    allow_failures: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks.

    Returns the per-rank return values in rank order. With ``allow_failures`` a
    failing rank's entry is a :class:`RankError` holding its traceback text instead
    of failing the call (ranks that time out still fail it).
    """
    port = free_port()
    queue = _CTX.Queue()
    procs = [
        _CTX.Process(
            target=_child, args=(fn, r, world_size, port, init, env or {}, args, queue), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value = queue.get(timeout=min(remaining, 0.5))
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
                continue
            results[rank] = (ok, value)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: v for r, (ok, v) in results.items() if not ok}
    missing = [r for r in range(world_size) if r not in results]
    if missing or (errors and not allow_failures):
        lines = [f"rank {r} did not finish within {timeout:.0f}s" for r in missing]
        lines += [f"rank {r} raised {v}" for r, v in sorted(errors.items())]
        raise RankFailure("\n".join(lines), errors)
    return [
        RankError(results[r][1]) if not results[r][0] else results[r][1] for r in range(world_size)
    ]


class RankError(str):
    """A failing rank's ``"Type: message\\ntraceback"`` text (``allow_failures=True``)."""
