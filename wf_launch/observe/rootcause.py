"""Turning what the ranks left behind into one verdict: status, root cause, summary."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..rundir import files
from ..rundir.failures import PEER_LOSS, culprit, load_failure_records
from ..rundir.io import open_regular
from .stacks import (
    Frame,
    describe_groups,
    group_spots,
    parse_traceback,
    rank_ranges,
    read_last_dumps,
    spot_of,
)

__all__ = [
    "FailureGroup",
    "death_of",
    "explain_failure",
    "failure_summary",
    "group_failures",
    "root_cause",
    "signal_name",
]


def signal_name(signum: int) -> str:
    """'SIGKILL' for 9, or 'signal 77' for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def root_cause(
    records: list[dict[str, Any]],
    exits: dict[int, int],
    world_size: int | None = None,
    dumps: dict[int, list[Frame]] | None = None,
) -> dict[str, Any] | None:
    """Pick the failure that explains the run.

    ``exits`` maps ranks that ended badly to their exit code, read as the failure
    was seen; negative means killed by that signal. SIGTERM is how the agent
    stops the survivors, so it names no cause. ``dumps`` are stack dumps of
    ranks taken when the failure was seen (or read back from their stacks
    files). Order of preference: when a collective timed out, the ranks that
    never arrived at it (no timeout of their own, and not at the waiters' spot);
    a rank killed by another signal (it cannot leave a record, and its peers'
    errors are consequences); the first rank that raised on its own; the first
    rank that lost a peer; any non-zero exit.
    """
    stuck = _stuck(records, world_size, dumps or {}, exits)
    if stuck is not None:
        return stuck
    killed = sorted(r for r, c in exits.items() if c < 0 and -c != signal.SIGTERM)
    if killed:
        return _signal_cause(killed[0], exits[killed[0]])
    primary = [r for r in records if not PEER_LOSS.search(r.get("message", ""))]
    if primary:
        return {**primary[0], "cause": "exception"}
    if records:
        return {**records[0], "cause": "exception"}
    rank = culprit(exits)
    if rank is not None:
        code = exits[rank]
        if code < 0:
            return _signal_cause(rank, code)
        return {
            "rank": rank,
            "cause": "exit",
            "type": "Exit",
            "message": f"exited with code {code}",
        }
    return None


def _waits(record: dict[str, Any]) -> bool:
    """Whether a rank's record shows it waiting: it timed out, or it lost a peer while waiting."""
    return record.get("kind") == "timeout" or bool(PEER_LOSS.search(record.get("message", "")))


def _waiting_spots(records: list[dict[str, Any]]) -> dict[int, Any]:
    """Where each waiting rank waited, from the traceback it recorded."""
    return {
        r["rank"]: spot_of(parse_traceback(r.get("traceback", ""))) for r in records if _waits(r)
    }


def _raised_elsewhere(records: list[dict[str, Any]]) -> bool:
    """Whether a rank raised something other than losing a peer: that, not a hang, is the cause."""
    return any(
        r.get("kind") == "exception" and not PEER_LOSS.search(r.get("message", "")) for r in records
    )


def _never_arrived_frames(never: list[int], dumped: dict[int, Any]) -> dict[str, Any]:
    """Where each rank that never arrived was: its dump's frame, or why there is none."""
    return {
        str(r): dumped[r].as_record()
        if r in dumped
        else {"frame": None, "note": "no stack dump (the rank had ended)"}
        for r in never
    }


def _stuck(
    records: list[dict[str, Any]],
    world_size: int | None,
    dumps: dict[int, list[Frame]],
    exits: dict[int, int],
) -> dict[str, Any] | None:
    """The timed-out collective's verdict: who waited where, who never arrived, where each was.

    A rank never arrived when it left no record of its own and its stack dump (if
    any) shows it somewhere other than where the ranks that timed out waited.
    """
    timed = [r for r in records if r.get("kind") == "timeout"]
    if not timed or not world_size or _raised_elsewhere(records):
        return None
    waiting = _waiting_spots(records)
    timed_spots = [waiting[r["rank"]] for r in timed]
    common = max(set(timed_spots), key=timed_spots.count)
    recorded = {r["rank"] for r in records}
    dumped = {r: spot_of(frames) for r, frames in dumps.items() if r not in recorded}
    never = sorted(r for r in range(world_size) if r not in recorded and dumped.get(r) != common)
    if not never:
        return None
    first = min(timed, key=lambda r: r.get("time", 0.0))
    return {
        **first,
        "cause": "stuck",
        "missing_ranks": never,
        "stuck": _never_arrived_frames(never, dumped),
        "_spots": _spots(waiting, dumped, common, never),
    }


def _spots(
    waiting: dict[int, Any], dumped: dict[int, Any], common: Any, never: list[int]
) -> dict[int, Any]:
    """Where each rank was: the waiting ranks, the dumped ones at the common spot, the missing."""
    return {
        **waiting,
        **{r: s for r, s in dumped.items() if s == common},
        **{r: dumped[r] for r in never if r in dumped},
    }


def _signal_cause(rank: int, exit_code: int) -> dict[str, Any]:
    name = signal_name(-exit_code)
    return {
        "rank": rank,
        "cause": "signal",
        "signal": name,
        "type": "Signal",
        "message": f"killed by {name}",
    }


_FATAL = re.compile(r"Fatal Python error: ([^\n]+)")
_LOG_TAIL = 16384
"""How much of a dead rank's log end is searched for what faulthandler wrote."""


def death_of(run_dir: Path | str, rank: int) -> str:
    """How a rank that left no failure record died, for a launcher that knows no exit code:
    what faulthandler wrote at the end of its log ('it crashed (Segmentation fault)'), else
    that its process ended without a record."""
    found: list[str] = []
    try:
        with open(open_regular(files.rank_log(run_dir, rank)), "rb") as f:
            f.seek(max(0, f.seek(0, 2) - _LOG_TAIL))
            found = _FATAL.findall(f.read().decode(errors="replace"))
    except (OSError, ValueError):
        pass
    if found:
        return f"it crashed ({found[-1].strip()})"
    return (
        "its process ended without a failure record (killed: SIGKILL, the OOM killer, or a crash)"
    )


def explain_failure(
    run_dir: Path,
    exits: dict[int, int],
    label_of: Any,
    coords_of: Any,
    world_size: int | None = None,
    dumps: dict[int, list[Frame]] | None = None,
) -> tuple[dict[str, Any], str] | None:
    """The root cause of a failed run, shaped for ``result.json``, and its summary (None: nothing
    explains it).

    Without ``dumps``, the last stack dump each rank left in its stacks file is used.
    """
    if dumps is None and world_size:
        dumps = read_last_dumps(
            run_dir, [r for r in files.rank_files(run_dir, "stacks") if r < world_size]
        )
    records = load_failure_records(run_dir)
    cause = root_cause(records, exits, world_size, dumps)
    if cause is None:
        return None
    summary = failure_summary(cause, label_of, run_dir, records)
    cause.pop("traceback", None)
    cause.pop("user_traceback", None)
    cause.pop("_spots", None)
    for rank, entry in (cause.get("stuck") or {}).items():
        if entry.get("frame"):
            entry["dump"] = str(files.rank_stacks(run_dir, int(rank)))
    cause["coords"] = coords_of(cause["rank"])
    cause["log"] = str(files.rank_log(run_dir, cause["rank"]))
    return cause, summary


def failure_summary(
    cause: dict[str, Any], label_of: Any, run_dir: Path, records: list[dict[str, Any]] | None = None
) -> str:
    """One human summary: the root cause (rank, coordinates, what happened, log), then every other
    failure once.

    Ranks that failed with the same exception at the same place are one entry, with one traceback
    (:func:`group_failures`); ranks that only lost a peer are one line per kind. The rank logs keep
    everything.
    """
    rank = cause["rank"]
    log = files.rank_log(run_dir, rank)
    groups = group_failures(records or [])
    if cause["cause"] == "stuck":
        return _stuck_summary(cause, label_of, run_dir)
    if cause["cause"] == "signal":
        lines = [f"rank {rank} ({label_of(rank)}) was killed by {cause['signal']}", f"  log: {log}"]
        return "\n".join(lines + [line for g in groups for line in g.describe(label_of, run_dir)])
    first = next((g for g in groups if rank in g.ranks), None)
    if first is None or (len(first.ranks) == 1 and first.exit is None):
        lines = [
            f"rank {rank} ({label_of(rank)}) failed first: "
            f"{cause['type']}: {_first_line(cause['message'])}",
            f"  log: {log}",
            *(first.traceback_lines() if first is not None else []),
        ]
    else:
        lines = first.describe(label_of, run_dir)
    return "\n".join(
        lines + [line for g in groups if g is not first for line in g.describe(label_of, run_dir)]
    )


def _stuck_summary(cause: dict[str, Any], label_of: Any, run_dir: Path) -> str:
    rank, missing = cause["rank"], cause["missing_ranks"]
    who = ", ".join(f"rank {m} ({label_of(m)})" for m in missing)
    lines = [f"collective timed out: {who} never arrived"]
    spots = cause.get("_spots")
    if spots:
        lines += describe_groups(group_spots(spots), label_of)
    else:
        lines.append(
            f"  rank {rank} ({label_of(rank)}) gave up waiting: {cause['type']}: "
            f"{_first_line(cause['message'])}"
        )
    lines.append(f"  logs: {', '.join(str(files.rank_log(run_dir, m)) for m in missing)}")
    dumped = [
        str(files.rank_stacks(run_dir, m))
        for m in missing
        if (cause.get("stuck") or {}).get(str(m), {}).get("frame")
    ]
    if dumped:
        lines.append(f"  stacks: {', '.join(dumped)}")
    return "\n".join(lines)


@dataclass
class FailureGroup:
    """Ranks that failed alike: the same exception type at the same place, messages equal but for
    numbers.
    """

    ranks: list[int]
    type: str
    messages: list[str]
    where: str | None
    traceback: str
    peer_loss: bool
    exit: str | None = None
    """'with code 3 at train.py:33 in main' for ranks whose script called ``sys.exit(3)``."""

    def traceback_lines(self) -> list[str]:
        """The group's one traceback (its first rank's), indented."""
        return (
            [f"  {line}" for line in self.traceback.rstrip().splitlines()] if self.traceback else []
        )

    def describe(self, label_of: Any, run_dir: Path) -> list[str]:
        """'ranks 0-7 (8 ranks) failed alike: ValueError: bad shape', their logs, one traceback."""
        first = self.ranks[0]
        who = (
            f"rank {first} ({label_of(first)})"
            if len(self.ranks) == 1
            else f"ranks {rank_ranges(self.ranks)} ({len(self.ranks)} ranks)"
        )
        message = _first_line(self.messages[0])
        if len(set(self.messages)) > 1:
            message += f" (the message varies by rank; rank {first}'s)"
        if self.peer_loss:
            return [f"{who} lost a peer (a consequence): {self.type}: {message}"]
        if self.exit is not None:
            who = f"rank {first}" if len(self.ranks) == 1 else who
            label = f" ({label_of(first)})" if len(self.ranks) == 1 else ""
            return [f"{who} exited {self.exit}{label}", f"  log: {files.rank_log(run_dir, first)}"]
        verb = "failed" if len(self.ranks) == 1 else "failed alike"
        logs = (
            str(files.rank_log(run_dir, first))
            if len(self.ranks) == 1
            else f"{files.rank_log(run_dir, first)} (and each rank's logs/rank{{r}}.log)"
        )
        return [f"{who} {verb}: {self.type}: {message}", f"  log: {logs}", *self.traceback_lines()]


_NUMBER = re.compile(r"\d+")


def group_failures(records: list[dict[str, Any]]) -> list[FailureGroup]:
    """The failure records grouped by (type, innermost frame, message with its numbers blanked),
    first failure first; ranks that only lost a peer are grouped apart from the ranks that
    raised."""
    groups: dict[tuple[Any, ...], FailureGroup] = {}
    for record in sorted(records, key=lambda r: (r.get("time", 0.0), r.get("rank", 0))):
        frames = parse_traceback(record.get("traceback", ""))
        where = frames[0].where() if frames else None
        message = str(record.get("message", ""))
        peer = bool(PEER_LOSS.search(message))
        key = (
            peer,
            record.get("type"),
            None if peer else where,
            _NUMBER.sub("#", _first_line(message)),
        )
        group = groups.get(key)
        if group is None:
            groups[key] = FailureGroup(
                [],
                str(record.get("type")),
                [],
                where,
                str(record.get("user_traceback") or record.get("traceback") or ""),
                peer,
                _exit_of(record),
            )
            group = groups[key]
        group.ranks.append(int(record.get("rank", -1)))
        group.messages.append(message)
    for group in groups.values():
        order = sorted(range(len(group.ranks)), key=lambda i: group.ranks[i])
        group.ranks, group.messages = (
            [group.ranks[i] for i in order],
            [group.messages[i] for i in order],
        )
    return sorted(groups.values(), key=lambda g: g.peer_loss)


def _exit_of(record: dict[str, Any]) -> str | None:
    """'with code 3 at train.py:33 in main' when the record is a script's ``sys.exit(3)``."""
    code, at = record.get("exit_code"), record.get("exit_at")
    if not isinstance(code, int) or not isinstance(at, str):
        return None
    return f"with code {code} at {at}"


def _first_line(text: str, limit: int = 500) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."
