"""The stop flag: signals only set it; tasks poll ``ctx.should_stop()`` at step boundaries.

A preemption warning (SLURM's ``--signal``), SIGTERM, or a local stop request
reach some ranks, maybe only one. :class:`StopFlag` records the signal on the
rank that saw it (the handler does nothing else: no I/O, no collectives) and
:meth:`StopFlag.should_stop` turns it into one answer that every rank gets at
the same call: a MAX all-reduce of the local flags over the world's CPU group,
posted without waiting (``async_op``) and read at the next call. So a call
costs a wait on a collective that has had a whole step to finish plus posting
the next one, and a stop seen during step ``k`` is agreed at the ``should_stop``
call after step ``k + 1`` on every rank alike. Only every ``every``-th call (10
by default) takes part in the agreement; the calls between return at once, so
the cost per call is a tenth of one small all-reduce, and a stop is agreed at
most ``2 * every`` steps after a rank saw it. Every rank must call it the same
number of times (at the same step boundaries), like any collective.

Two stops are told apart, and agreed alike: the scheduler's preemption warning
(:attr:`StopFlag.preempt_signal`, e.g. SIGUSR2 on SLURM: the job goes back to the queue) and
any other (SIGTERM, a Ctrl-C passed on: the run stops for good). A rank that saw the warning
posts 1, one that saw another stop 2; the MAX wins, so a user's stop is never turned into a
requeue (:attr:`StopFlag.for_preemption`).
"""

from __future__ import annotations

import signal
import time
from typing import Any

from worldfoundry.core.distributed.backends import group_device
from worldfoundry.core.validation import is_int

__all__ = ["StopFlag"]


class StopFlag:
    """One rank's view of "stop at the next step boundary"."""

    def __init__(self, group: Any = None, every: int = 10) -> None:
        if not is_int(every) or every < 1:
            raise ValueError(
                f"StopFlag(every={every!r}): expected an integer >= 1 (agree every N calls)"
            )
        self.group = group
        self.every = every
        self.preempt_signal: str | None = None
        """The scheduler's preemption warning ('SIGUSR2'), set by the entrypoint."""
        self._code = 0
        self.calls = 0
        self.requested: str | None = None
        self.requested_at: float | None = None
        self.polled = False
        self._work: Any = None
        self._buf: Any = None
        self._agreed = False
        self._previous: dict[int, Any] = {}

    def request(self, why: str) -> None:
        """Ask to stop (async-signal-safe: sets two attributes)."""
        if self.requested is None:
            self.requested, self.requested_at = why, time.time()

    def install(self, *signums: int) -> None:
        """Make ``signums`` set the flag (instead of their default action) in this rank."""

        def handler(signum: int, frame: Any) -> None:
            self.request(signal.Signals(signum).name)

        for signum in signums:
            self._previous[signum] = signal.signal(signum, handler)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    @property
    def agreed(self) -> bool:
        """Whether a :meth:`should_stop` call has returned True."""
        return self._agreed

    @property
    def for_preemption(self) -> bool:
        """Whether the agreed stop is the scheduler's preemption warning alone (no rank saw
        another stop): the job is requeued rather than ended."""
        return self._agreed and self._code == 1

    def _local_code(self) -> int:
        """0: no stop seen here; 1: the preemption warning; 2: any other stop."""
        if self.requested is None:
            return 0
        return 1 if self.requested == self.preempt_signal else 2

    def should_stop(self) -> bool:
        """Whether every rank has agreed to stop (the same answer on every rank at the same
        call)."""
        import torch
        import torch.distributed as dist

        self.polled = True
        if self._agreed:
            return True
        self.calls += 1
        if (self.calls - 1) % self.every:
            return False
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            self._code = self._local_code()
            self._agreed = self._code > 0
            return self._agreed
        if self._work is not None:
            self._work.wait()
            self._code = int(self._buf.item())
            self._agreed = self._code > 0
            if self._agreed:
                self._work = None
                return True

        self._buf = torch.tensor(
            [self._local_code()],
            dtype=torch.int32,
            device=group_device(self.group, control=True),
        )  # CUDA on an NCCL-only group
        self._work = dist.all_reduce(
            self._buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True
        )
        return False

    def forget(self) -> None:
        """The group went away under the flag (its owner destroyed it): drop the collective in
        flight."""
        self._work = None

    def drain(self) -> None:
        """Wait for the collective still in flight (before the groups are torn down)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
