"""Pipeline-parallel (PP) point-to-point scheduling between ring neighbours of the pp group.

:class:`PPScheduler` sends to the next stage and receives from the previous one (ring order of
``groups.get_pp_group()``; the last stage's next is the first). Receives can be posted ahead of time
with :meth:`PPScheduler.queue_irecv_prev` and collected in the same (FIFO) order with
:meth:`PPScheduler.queue_irecv_prev_data`; messages from one peer are matched in posting order, so
the n-th queued receive gets the n-th message sent.

One scheduler exists per runtime (:func:`init_pp_scheduler` /
:func:`pp_scheduler`); it lives in the runtime's PP scheduler slot
(:attr:`.runtime.Runtime.pp_scheduler`), so ``groups.destroy_model_parallel``
(which closes the runtime) drops it and any pending receives, and the process
can be initialized again with another layout.
"""

from __future__ import annotations

from collections import deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..validation import is_number
from . import groups as _groups
from . import runtime as _rt
from .backends import group_device

__all__ = ["PPScheduler", "init_pp_scheduler", "pp_scheduler"]

Timeout = timedelta | float | None
"""A ``timedelta``, seconds as a number, or ``None`` for the group's own timeout."""


def _as_timedelta(timeout: Timeout, name: str = "timeout") -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        if isinstance(timeout, timedelta) and timeout.total_seconds() <= 0:
            raise ValueError(f"{name} must be positive, got {timeout!r}")
        return timeout
    if not is_number(timeout) or timeout <= 0:
        raise ValueError(
            f"{name} must be a positive number of seconds, a timedelta or None, got {timeout!r}"
        )
    return timedelta(seconds=float(timeout))


class PPScheduler:
    """Send to the next pp stage, receive from the previous one; queued receives complete in FIFO
    order.

    ``group`` defaults to ``groups.get_pp_group()``. Its ``next_rank`` /
    ``prev_rank`` are global ranks; its ``device_group`` carries the traffic.
    Receive buffers live on ``device`` (default: the current CUDA device when the
    group's backend is NCCL, else the CPU). ``timeout`` bounds every wait on a
    receive (default: the group's own timeout). ``tag`` marks this scheduler's
    messages on backends that honour tags (gloo), so a receive left pending by a
    scheduler that was reset can never swallow a later scheduler's message.
    """

    def __init__(
        self,
        group: Any = None,
        device: torch.device | str | None = None,
        timeout: Timeout = None,
        tag: int = 0,
    ) -> None:
        self.group = _groups.get_pp_group() if group is None else group
        self._pg = self.group.device_group
        self.next_rank: int = self.group.next_rank
        self.prev_rank: int = self.group.prev_rank
        self.device = torch.device(device) if device is not None else group_device(self._pg)
        self.timeout = _as_timedelta(timeout)
        self.tag = tag
        self._queue: deque[tuple[torch.Tensor, dist.Work]] = deque()
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"PPScheduler(ranks={self.group.ranks}, rank={self.group.rank}, next={self.next_rank}, "
            f"prev={self.prev_rank}, device={self.device}, pending={len(self._queue)})"
        )

    @property
    def pending(self) -> int:
        """Receives queued by :meth:`queue_irecv_prev` and not yet collected."""
        return len(self._queue)

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"PPScheduler.{what}: this scheduler was reset (destroy_model_parallel); "
                "use pp_scheduler() after re-initializing"
            )
        if self.group.world_size < 2:
            raise RuntimeError(
                f"PPScheduler.{what}: the pp group has one rank ({self.group.ranks}); "
                "there is no neighbour stage to talk to"
            )

    def isend_next(self, t: torch.Tensor) -> dist.Work:
        """Start sending ``t`` to the next stage; wait on the returned handle before reusing
        ``t``."""
        self._check_usable("isend_next")
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"PPScheduler.isend_next: t must be a torch.Tensor, got {type(t).__name__}"
            )
        return dist.isend(t.detach().contiguous(), dst=self.next_rank, group=self._pg, tag=self.tag)

    def irecv_prev(self, buf: torch.Tensor) -> dist.Work:
        """Start receiving the previous stage's next message into ``buf`` (contiguous, right
        shape)."""
        self._check_usable("irecv_prev")
        if not isinstance(buf, torch.Tensor) or not buf.is_contiguous():
            what = (
                "a non-contiguous tensor" if isinstance(buf, torch.Tensor) else type(buf).__name__
            )
            raise ValueError(
                f"PPScheduler.irecv_prev: buf must be a contiguous torch.Tensor, got {what}"
            )
        return self._irecv(buf)

    def _irecv(self, buf: torch.Tensor) -> dist.Work:
        return dist.irecv(buf, src=self.prev_rank, group=self._pg, tag=self.tag)

    def _new_buffer(self, shape: Any, dtype: torch.dtype, what: str) -> torch.Tensor:
        try:
            size = torch.Size(shape)
        except TypeError as e:
            raise ValueError(
                f"PPScheduler.{what}: shape must be a sequence of ints, got {shape!r}"
            ) from e
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"PPScheduler.{what}: dtype must be a torch.dtype, got {dtype!r}")
        return torch.empty(size, dtype=dtype, device=self.device)

    def _wait(
        self, buf: torch.Tensor, work: dist.Work, timeout: Timeout, what: str
    ) -> torch.Tensor:
        limit = _as_timedelta(timeout) or self.timeout
        try:
            work.wait() if limit is None else work.wait(limit)
        except RuntimeError as e:
            within = "" if limit is None else f" within {limit.total_seconds():g}s"
            raise RuntimeError(
                f"PPScheduler.{what}: receiving a {tuple(buf.shape)} {buf.dtype} tensor from "
                f"global rank {self.prev_rank} did not complete{within}: {e}"
            ) from e
        return buf

    def recv_prev_data(
        self, shape: Any, dtype: torch.dtype, timeout: Timeout = None
    ) -> torch.Tensor:
        """Receive the previous stage's next message into a new ``shape`` / ``dtype`` tensor and
        return it.

        It is matched after every receive already queued (FIFO).
        """
        self._check_usable("recv_prev_data")
        buf = self._new_buffer(shape, dtype, "recv_prev_data")
        return self._wait(buf, self._irecv(buf), timeout, "recv_prev_data")

    def queue_irecv_prev(self, shape: Any, dtype: torch.dtype) -> None:
        """Post a receive of a ``shape`` / ``dtype`` message from the previous stage; collect it
        later."""
        self._check_usable("queue_irecv_prev")
        buf = self._new_buffer(shape, dtype, "queue_irecv_prev")
        self._queue.append((buf, self._irecv(buf)))

    def queue_irecv_prev_data(self, timeout: Timeout = None) -> torch.Tensor:
        """Wait for the oldest queued receive and return its tensor.

        Raises RuntimeError at once when nothing is queued (instead of blocking),
        and when the wait fails or exceeds ``timeout`` (the scheduler's, else the
        group's); the entry is dropped either way.
        """
        if self._closed:
            self._check_usable("queue_irecv_prev_data")
        if not self._queue:
            raise RuntimeError(
                "PPScheduler.queue_irecv_prev_data: no receive is queued; call "
                "queue_irecv_prev(shape, dtype) first (one call per message)"
            )
        buf, work = self._queue.popleft()
        return self._wait(buf, work, timeout, "queue_irecv_prev_data")

    def close(self) -> None:
        """Drop pending receives (their buffers are never returned) and refuse further use."""
        self._queue.clear()
        self._closed = True


def init_pp_scheduler(timeout: Timeout = None) -> PPScheduler:
    """Create the process-wide :class:`PPScheduler` on this rank's pp group and return it.

    Raises RuntimeError if one exists already (``destroy_model_parallel()``
    resets it) or the model-parallel groups are not initialized. Each new
    scheduler gets a new tag (every rank counts alike).
    """
    rt = _rt.current()
    if rt.pp_scheduler is not None:
        raise RuntimeError(
            f"init_pp_scheduler: the PP scheduler is already initialized ({rt.pp_scheduler!r}); "
            "call destroy_model_parallel() before initializing it again"
        )
    group = _groups.get_pp_group()
    rt.pp_generation += 1
    rt.pp_scheduler = PPScheduler(group, timeout=timeout, tag=rt.pp_generation)
    return rt.pp_scheduler


def pp_scheduler() -> PPScheduler:
    """The process-wide :class:`PPScheduler`; RuntimeError if it was not initialized."""
    scheduler = _rt.current().pp_scheduler
    if scheduler is None:
        raise RuntimeError(
            "the PP scheduler is not initialized: call "
            "worldfoundry.core.distributed.dist_init(config) with pp_size > 1, or "
            "init_pp_scheduler() after initialize_model_parallel(...)"
        )
    return scheduler


def _reset_pp_scheduler() -> None:
    """Drop the process-wide scheduler and its pending receives (the runtime's close does the same).

    Posted receives cannot be cancelled through torch.distributed; they are
    forgotten. On gloo the next scheduler uses a new tag, so one still posted on
    a group that survives (the world group when pp spans every rank) never
    matches its messages. NCCL ignores tags: drain queued receives before a reset.
    """
    rt = _rt.current()
    scheduler, rt.pp_scheduler = rt.pp_scheduler, None
    if scheduler is not None:
        scheduler.close()
