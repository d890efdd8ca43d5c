"""Inside a local rank process: signal set-up, dying with the launcher, then the shared
entrypoint."""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any

from worldfoundry.core.distributed.env import ATTEMPT_ENV

from ...rank.entrypoint import RankSpec, rank_main
from ...rank.hardexit import exit_status, flush_and_exit
from ...rundir.pids import die_with_parent

if TYPE_CHECKING:
    from .agent import ForkGate

__all__ = ["HELD_AT_FORK", "local_rank_entry"]

HELD_AT_FORK = frozenset({signal.SIGINT, signal.SIGTERM})
"""Blocked while the launcher forks ranks (a fork keeps the mask). A forked rank inherits the
launcher's handlers: a Ctrl-C, or the SIGTERM that stops the ranks after it, reaching a rank
still in multiprocessing's bootstrap would run them there and print a traceback (CI met it).
The rank resets both, then unblocks: a pending one then acts as the rank's own. A spawned rank
blocks only SIGINT: a SIGTERM must still end a rank that is importing torch."""


def _parent_chain(depth: int) -> list[int]:
    """This process's parent, grandparent, ... (``depth`` of them; forkserver ranks are
    grandchildren)."""
    chain, pid = [], os.getpid()
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            pid = os.getppid() if not chain else 0
        chain.append(pid)
    return chain


def local_rank_entry(
    spec: RankSpec, launcher_pid: int, gate: ForkGate | None = None
) -> dict[str, Any]:
    """What each local rank process runs: signal set-up, then the shared entrypoint."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_AT_FORK)
    if gate is not None:
        gate.wait()  # before any libc call that may take a lock a launcher thread held at fork
    die_with_parent(signal.SIGKILL)
    if launcher_pid not in _parent_chain(2):
        os._exit(1)
    os.environ[ATTEMPT_ENV] = str(
        spec.attempt_base + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    )
    try:
        return rank_main(spec)
    except BaseException as exc:
        flush_and_exit(exit_status(exc))
