"""The hang watch of ``ft=torchft``: a replica group that neither steps nor waits for a quorum for
``ft.hang_timeout_s``, while another group does, is hung. The launcher kills its ranks; its agent
restarts it and it heals, as after any failure.

Why the launcher must act: a hung group still heartbeats to the Lighthouse (its rank 0's Manager
answers from a thread of its own), and the Lighthouse forms no quorum of half or fewer of the
groups that heartbeat (torchft's guard against a split brain). With two groups the survivor waits
for the hung one until its quorum request times out, and then fails too. Step progress cannot
tell the two apart (neither steps); where each group's rank 0 is can
(:func:`wf_launch.rundir.files.ft_phase`): the survivor waits for a quorum, the hung group is
stuck in a step.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil
from loguru import logger

from ..rank.ft import QUORUM, STEP, append_event
from ..rundir import files
from ..rundir.io import read_text
from ..rundir.pids import live_rank_pid
from .ft_record import read_events

__all__ = ["HangWatch", "Phase", "hung_groups", "read_phase"]


@dataclass(frozen=True)
class Phase:
    """Where a replica group's rank 0 is: waiting for a ``quorum`` or in a ``step``, since when."""

    phase: str
    since: float
    step: int
    first: bool = False


def read_phase(replica_dir: Path) -> Phase | None:
    """The group's :class:`Phase` (None before its first quorum, or if unreadable)."""
    try:
        data = json.loads(read_text(files.ft_phase(replica_dir)))
        first = bool(data.get("first", False))
        return Phase(str(data["phase"]), float(data["since"]), int(data["step"]), first)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def hung_groups(phases: Mapping[int, Phase], now: float, timeout_s: float) -> dict[int, list[int]]:
    """The hung groups, each with the groups still going meanwhile (waiting or stepping).

    ``phases`` holds only the groups of their current attempt (a group restarting has none).
    A group is hung when it has been in one step for ``timeout_s`` while another group waits for
    a quorum or stepped since; when every group is stuck alike, none is (a long step of all). A
    group waiting for its attempt's first quorum is no evidence: it is joining or healing, and
    the others may still be in a step whose all-reduce with its dead attempt has to time out.
    """
    waiting = {k for k, p in phases.items() if p.phase == QUORUM and not p.first}
    going = waiting | {
        k for k, p in phases.items() if p.phase == STEP and now - p.since < timeout_s
    }
    return {
        k: sorted(going - {k})
        for k, p in phases.items()
        if p.phase == STEP and now - p.since >= timeout_s and going - {k}
    }


class HangWatch:
    """Polled by the replica groups' supervisor: tears down each group :func:`hung_groups` finds."""

    def __init__(self, run_dir: Path, replicas: int, ranks: int, timeout_s: float) -> None:
        self.run_dir, self.replicas, self.ranks = Path(run_dir), replicas, ranks
        self.timeout_s = timeout_s
        self.started = time.time()  # a phase written before is an earlier launch's (a resume)
        self.torn_down: dict[int, float] = {}

    def _current(self, k: int) -> Phase | None:
        """Group ``k``'s phase if it is of its current attempt (this launch, after its last failure
        or tear-down)."""
        replica_dir = files.ft_replica_dir(self.run_dir, k)
        phase = read_phase(replica_dir)
        if phase is None:
            return None
        failed = [
            e.get("time", 0.0) for e in read_events(replica_dir) if e.get("event") == "failed"
        ]
        after = max([*failed, self.torn_down.get(k, 0.0), self.started])
        return phase if phase.since > after else None

    def check(self, alive: set[int]) -> list[int]:
        """Tear down every hung group of ``alive``; the groups torn down."""
        phases = {k: p for k in sorted(alive) if (p := self._current(k)) is not None}
        now = time.time()
        hung = hung_groups(phases, now, self.timeout_s)
        for k, going in hung.items():
            self._tear_down(k, phases[k], going, now)
        return sorted(hung)

    def _tear_down(self, k: int, phase: Phase, going: list[int], now: float) -> None:
        replica_dir = files.ft_replica_dir(self.run_dir, k)
        seconds = round(now - phase.since, 3)
        pids = {r: pid for r in range(self.ranks) if (pid := live_rank_pid(replica_dir, r))}
        append_event(
            replica_dir,
            event="hung",
            step=phase.step,
            seconds=seconds,
            while_going=going,
            stopped=[r for r, pid in pids.items() if _stopped(pid)],
        )
        logger.warning(
            f"ft: replica group {k} is hung: no step done for {seconds:.0f} s after step "
            f"{phase.step} (ft.hang_timeout_s={self.timeout_s:g}) while replica group(s) {going} "
            "went on; killing its ranks: it restarts and heals"
        )
        self.torn_down[k] = now
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger): a hang it cannot even report."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False
