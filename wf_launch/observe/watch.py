"""The launcher's eyes on running ranks: a bound and a heartbeat for start-up, stacks when things go
wrong.

:class:`RankWatch` is polled by the local launcher's agent between its checks of
the rank processes. While ranks start it prints a heartbeat once start-up takes
longer than a few seconds ("31/32 ranks arrived; waiting for rank 24 (tp0 cp0 pp0
dp24), 12 s"), and when ``engine.init_timeout_s`` passes it dumps the stacks of
the ranks that never joined and raises :class:`StartupTimeout`, which fails the
run with those ranks named, never a silent wait. When a rank fails, the launcher
asks it for an :meth:`RankWatch.autopsy`: the stacks of every rank still alive,
taken before the survivors are stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..rundir import files
from ..rundir.failures import load_failure_records
from .stacks import (
    DUMP_SIGNAL,
    Frame,
    collect_dumps,
    describe_groups,
    group_spots,
    rank_ranges,
    spot_of,
    stack_offsets,
    trigger,
)

__all__ = ["PEERS_GRACE_S", "RankWatch", "StartupTimeout", "a_collective_timed_out"]

PEERS_GRACE_S = 3.0
"""How long a failed attempt waits for the peers of a timed-out collective to end on their own
before any stack dump: they time out moments after the first, each recording where it waited; a
dump taken first would catch one in the middle of recording and count it as never arrived."""


def a_collective_timed_out(run_dir: Path) -> bool:
    """Whether a rank recorded a collective timeout (its peers are about to record theirs)."""
    return any(r.get("kind") == "timeout" for r in load_failure_records(run_dir))


class StartupTimeout(Exception):
    """Ranks did not join the process groups within ``engine.init_timeout_s``."""

    def __init__(
        self,
        timeout_s: float,
        phase: str,
        done: int,
        missing: list[int],
        dumps: dict[int, list[Frame]],
    ) -> None:
        who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {rank_ranges(missing)}"
        super().__init__(
            f"start-up timed out after {timeout_s:g} s (engine.init_timeout_s): "
            f"{done}/{done + len(missing)} ranks {phase}; {who} never did"
        )
        self.timeout_s = timeout_s
        self.missing = missing
        self.dumps = dumps

    def failure(
        self, run_dir: Path, label: Callable[[int], str], coords: Callable[[int], Any]
    ) -> tuple[dict[str, Any], str]:
        """The run's failure record and summary: the ranks that never joined, where each stood."""
        spots = {r: spot_of(frames) for r, frames in self.dumps.items()}
        logs = ", ".join(str(files.rank_log(run_dir, r)) for r in self.missing[:8])
        lines = [str(self), *describe_groups(group_spots(spots), label)]
        lines.append(f"  logs: {logs}" + (" ..." if len(self.missing) > 8 else ""))
        stuck = {
            str(r): {**spots[r].as_record(), "dump": str(files.rank_stacks(run_dir, r))}
            if r in spots
            else {"frame": None, "note": "no stack dump"}
            for r in self.missing
        }
        first = self.missing[0]
        cause = {
            "rank": first,
            "cause": "init_timeout",
            "type": "StartupTimeout",
            "message": str(self),
            "missing_ranks": self.missing,
            "stuck": stuck,
            "coords": coords(first),
            "log": str(files.rank_log(run_dir, first)),
        }
        return cause, "\n".join(lines)


class RankWatch:
    """Start-up heartbeat and bound, and stack autopsies, for the ranks of one launch."""

    def __init__(
        self,
        run_dir: Path,
        world_size: int,
        label_of: Callable[[int], str],
        init_timeout_s: float,
        write: Callable[[str], None],
        heartbeat_after_s: float = 5.0,
        heartbeat_every_s: float = 5.0,
        progress: Any = None,
        send: Callable[[dict[int, int], int], set[int]] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.world_size = world_size
        self.label_of = label_of
        self.init_timeout_s = init_timeout_s
        self.write = write
        self.heartbeat_after_s = heartbeat_after_s
        self.heartbeat_every_s = heartbeat_every_s
        self.send = send  # (rank -> pid, signal) -> the ranks reached; Ray's reaches every node
        self.progress = (
            progress  # a ProgressMonitor ticked from here: no thread in the forking launcher
        )
        self.restart()

    def restart(self) -> None:
        """The ranks were (re)started: start-up is watched from now, and earlier attempts' markers
        forgotten."""
        self.started = time.monotonic()
        self._last_beat = self.started
        self._all_joined = False
        for rank in range(self.world_size):
            for phase in ("arrived", "joined"):
                files.rank_marker(self.run_dir, rank, phase).unlink(missing_ok=True)

    def reached(self, phase: str) -> set[int]:
        """Ranks that have ``arrived`` at ``dist_init`` or ``joined`` the groups."""
        return {
            r for r in range(self.world_size) if files.rank_marker(self.run_dir, r, phase).exists()
        }

    def joined(self) -> set[int]:
        return self.reached("joined")

    def tick(self, pids: dict[int, int]) -> None:
        """Between checks of the ranks: progress, heartbeat while they start,
        :class:`StartupTimeout` past the bound."""
        if self.progress is not None:
            self.progress.maybe_tick()
        if self._all_joined:
            return
        joined = self.joined()
        if len(joined) == self.world_size:
            self._all_joined = True
            if time.monotonic() - self.started >= self.heartbeat_after_s:
                self.write(
                    f"all {self.world_size} ranks joined in {time.monotonic() - self.started:.0f} s"
                )
            return
        now = time.monotonic()
        elapsed = now - self.started
        arrived = self.reached("arrived")
        phase, done = ("arrived", arrived) if len(arrived) < self.world_size else ("joined", joined)
        missing = sorted(set(range(self.world_size)) - done)
        if elapsed >= self.init_timeout_s:
            raise StartupTimeout(self.init_timeout_s, phase, len(done), missing, self.autopsy(pids))
        if elapsed >= self.heartbeat_after_s and now - self._last_beat >= self.heartbeat_every_s:
            self._last_beat = now
            who = (
                f"rank {missing[0]} ({self.label_of(missing[0]).split(' ', 1)[-1]})"
                if len(missing) == 1
                else f"ranks {rank_ranges(missing)}"
            )
            self.write(
                f"{len(done)}/{self.world_size} ranks {phase}; waiting for {who}, {elapsed:.0f} s"
            )

    def autopsy(
        self, pids: dict[int, int], wait_s: float = 2.0, alive: Callable[[int], bool] | None = None
    ) -> dict[int, list[Frame]]:
        """Dump the stacks of the ranks in ``pids`` (rank -> pid) now; each one's main-thread
        frames.

        ``alive`` (rank -> still running?) lets it stop waiting for a rank that exited instead of
        dumping.
        """
        if not pids:
            return {}
        offsets = stack_offsets(self.run_dir, pids)
        sent = trigger(pids) if self.send is None else self.send(pids, int(DUMP_SIGNAL))
        return collect_dumps(self.run_dir, sent, offsets, wait_s=wait_s, alive=alive)
