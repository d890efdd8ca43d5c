"""The hang watch of ``ft=torchft``: a replica group with a rank in one step for
``ft.hang_timeout_s``, while another group has moved on since that step began, is hung. The
launcher kills its ranks; its agent restarts it and it heals, as after any failure.

Why the launcher must act: a hung group still heartbeats to the Lighthouse (its rank 0's Manager
answers from a thread of its own), and the Lighthouse forms no quorum of half or fewer of the
groups that heartbeat (torchft's guard against a split brain). With two groups the survivor waits
for the hung one until its quorum request times out, and then fails too. Step progress cannot tell
the two apart (neither steps); where each rank is can (:func:`wf_launch.rundir.files.ft_phase`).
The hung rank stays in its step. The others of its group may wait in a collective for it, or, done
with the step, for the next quorum (torchft's Manager waits for all its group's ranks). The ranks
of a group waiting for it wait in a collective too, until it gives up after ``ft.timeout_s``; then
they wait for a quorum, and the hung group is the one left with a rank in a step.

A long step alone is no evidence: a group that came late into the same step (slow to start, or
healing) keeps the others waiting in its collective. Only news from after the stuck step began
counts: another group waiting for a quorum since then for half the hang timeout, or two steps on.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil
from loguru import logger

from ..rank.ft import QUORUM, STEP, append_event, phase_of
from ..rundir import files
from ..rundir.pids import live_rank_pid
from .ft_record import read_events

__all__ = ["HangWatch", "Phase", "hung_groups", "kill_here", "read_phase"]


@dataclass(frozen=True)
class Phase:
    """Where a rank is: waiting for a ``quorum`` or in a ``step``, since when."""

    phase: str
    since: float
    step: int
    first: bool = False

    def stuck(self, now: float, timeout_s: float) -> bool:
        """In one step for ``timeout_s`` or more."""
        return self.phase == STEP and now - self.since >= timeout_s

    def going(self, now: float, timeout_s: float) -> bool:
        """Waiting for a quorum after a step, or stepping within ``timeout_s``. A rank waiting for
        its attempt's first quorum is no evidence: it is joining or healing, and the others may
        still be in a step whose collective with its dead attempt has to time out."""
        if self.phase == QUORUM:
            return not self.first
        return not self.stuck(now, timeout_s)

    def moved_on(self, since: float, step: int, now: float, grace_s: float) -> bool:
        """Past a rank stuck in ``step`` since ``since``: waiting for a quorum (not its first)
        since after that for ``grace_s``, or two steps on. A rank just done with the same step is
        not: the stuck one may be about to end it too."""
        if self.first or self.since <= since:
            return False
        if self.step >= step + 2:
            return True
        return self.phase == QUORUM and now - self.since >= grace_s


Group = Mapping[int, Phase]
"""A replica group's ranks' phases, by group rank (only those of its current attempt)."""


def read_phase(replica_dir: Path, rank: int) -> Phase | None:
    """Rank ``rank``'s :class:`Phase` (None before its first quorum, or if unreadable)."""
    data = phase_of(replica_dir, rank)
    if data is None:
        return None
    try:
        first = bool(data.get("first", False))
        return Phase(str(data["phase"]), float(data["since"]), int(data["step"]), first)
    except (ValueError, KeyError, TypeError):
        return None


def stuck_ranks(group: Group, now: float, timeout_s: float) -> list[int]:
    """The group's ranks in one step for ``timeout_s`` or more."""
    return sorted(r for r, p in group.items() if p.stuck(now, timeout_s))


def hung_groups(
    groups: Mapping[int, Group],
    now: float,
    timeout_s: float,
    ranks: int,
    stopped: Mapping[int, Collection[int]] | None = None,
) -> dict[int, list[int]]:
    """The hung groups (of ``ranks`` ranks each), each with the groups that went on meanwhile.

    Only a whole group with no stuck or stopped rank can go on, so the groups waiting for a hung
    one are not torn down because of it, and when every group is stuck (a long step of all) none
    is hung. A group with a rank ``stopped`` (by a signal, for ``timeout_s``, wherever it is) is
    hung while another group is going (:meth:`Phase.going`): a stopped process never ends its
    step. A group with a rank stuck in a step is hung once every rank of another group has moved
    on since (:meth:`Phase.moved_on`, with half of ``timeout_s`` to wait for a quorum).
    """
    stopped = stopped or {}
    going = [
        k
        for k, group in sorted(groups.items())
        if len(group) == ranks
        and not stopped.get(k)
        and all(p.going(now, timeout_s) for p in group.values())
    ]
    hung = {
        k: _went_on(groups, k, [j for j in going if j != k], now, timeout_s, bool(stopped.get(k)))
        for k in groups
    }
    return {k: went_on for k, went_on in hung.items() if went_on}


def _went_on(
    groups: Mapping[int, Group],
    k: int,
    going: list[int],
    now: float,
    timeout_s: float,
    stopped: bool,
) -> list[int]:
    """Of the other groups ``going``, those that show group ``k`` hung: all of them if ``k`` has
    a stopped rank, else (if it has a stuck one) those whose every rank moved on since."""
    if stopped:
        return going
    group = groups[k]
    stuck = stuck_ranks(group, now, timeout_s)
    if not stuck:
        return []
    since = min(group[r].since for r in stuck)
    step = min(group[r].step for r in stuck)
    return [
        j
        for j in going
        if all(p.moved_on(since, step, now, timeout_s / 2) for p in groups[j].values())
    ]


class HangWatch:
    """Polled by the replica groups' supervisor: tears down each group :func:`hung_groups` finds."""

    def __init__(
        self,
        run_dir: Path,
        replicas: int,
        ranks: int,
        timeout_s: float,
        kill: Callable[[Path, dict[int, int]], None] | None = None,
    ) -> None:
        self.run_dir, self.replicas, self.ranks = Path(run_dir), replicas, ranks
        self.timeout_s = timeout_s
        self.kill = kill or kill_here  # (replica dir, rank -> pid of the ranks on this host)
        self.started = time.time()  # a phase written before is an earlier launch's (a resume)
        self.torn_down: dict[int, float] = {}
        self.stopped_since: dict[tuple[int, int], tuple[int, float]] = {}

    def _current(self, k: int) -> dict[int, Phase]:
        """Group ``k``'s ranks' phases of its current attempt (this launch, after its last
        failure or tear-down)."""
        replica_dir = files.ft_replica_dir(self.run_dir, k)
        failed = [
            e.get("time", 0.0) for e in read_events(replica_dir) if e.get("event") == "failed"
        ]
        after = max([*failed, self.torn_down.get(k, 0.0), self.started])
        phases = {r: read_phase(replica_dir, r) for r in range(self.ranks)}
        return {r: p for r, p in phases.items() if p is not None and p.since > after}

    def _stopped_long(self, k: int, now: float) -> list[int]:
        """Group ``k``'s ranks stopped by a signal (SIGSTOP) for ``timeout_s``: a hang wherever
        the rank is, even in the instant between writing its quorum phase and asking for the
        quorum, where every rank would look like waiting. A debugger's stop is not counted."""
        replica_dir = files.ft_replica_dir(self.run_dir, k)
        out = []
        for r in range(self.ranks):
            pid = live_rank_pid(replica_dir, r)
            if pid is None or not _stopped(pid, debugger=False):
                self.stopped_since.pop((k, r), None)
                continue
            seen_pid, since = self.stopped_since.setdefault((k, r), (pid, now))
            if seen_pid != pid:
                self.stopped_since[(k, r)] = (pid, now)
            elif now - since >= self.timeout_s:
                out.append(r)
        return out

    def check(self, alive: set[int]) -> list[int]:
        """Tear down every hung group of ``alive``; the groups torn down."""
        groups = {k: self._current(k) for k in sorted(alive)}
        now = time.time()
        stopped = {k: self._stopped_long(k, now) for k in sorted(alive)}
        hung = hung_groups(groups, now, self.timeout_s, self.ranks, stopped)
        for k, going in hung.items():
            self._tear_down(k, groups[k], going, now)
        return sorted(hung)

    def _tear_down(self, k: int, group: Group, going: list[int], now: float) -> None:
        replica_dir = files.ft_replica_dir(self.run_dir, k)
        stuck = stuck_ranks(group, now, self.timeout_s)
        pids = {r: pid for r in range(self.ranks) if (pid := live_rank_pid(replica_dir, r))}
        stopped = [r for r, pid in pids.items() if _stopped(pid)]
        named = [group[r] for r in stuck] or [group[r] for r in stopped if r in group]
        since = min((p.since for p in named), default=now)
        step = min((p.step for p in named), default=-1)
        seconds = round(now - since, 3)
        append_event(
            replica_dir,
            event="hung",
            step=step,
            seconds=seconds,
            stuck=stuck,
            while_going=going,
            stopped=stopped,
        )
        why = f" (stopped: rank(s) {stopped}, by a signal or a debugger)" if stopped else ""
        what = (
            f"rank(s) {stuck} did not end step {step} in {seconds:.0f} s{why}"
            if stuck
            else f"rank(s) {stopped} stopped (by a signal) at step {step}"
        )
        logger.warning(
            f"ft: replica group {k} is hung: {what} (ft.hang_timeout_s={self.timeout_s:g}) while "
            f"replica group(s) {going} went on; killing its ranks: it restarts and heals"
        )
        self.torn_down[k] = now
        for r in pids:
            self.stopped_since.pop((k, r), None)
        self.kill(replica_dir, pids)


def kill_here(replica_dir: Path, pids: dict[int, int]) -> None:
    """SIGKILL the group's ranks (all on this host: the local launcher's)."""
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _stopped(pid: int, debugger: bool = True) -> bool:
    """Whether the process is stopped: by a signal (SIGSTOP: a hang it cannot even report), or,
    with ``debugger``, by a debugger."""
    states = (
        (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
        if debugger
        else (psutil.STATUS_STOPPED,)
    )
    try:
        return psutil.Process(pid).status() in states
    except psutil.Error:
        return False
