"""Turning what the ranks left behind into one verdict: status, root cause, summary."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from ..rundir import files
from ..rundir.failures import PEER_LOSS, load_failure_records
from .stacks import Frame, describe_groups, group_spots, parse_traceback, read_last_dumps, spot_of

__all__ = ["explain_failure", "failure_summary", "root_cause", "signal_name"]

def signal_name(signum: int) -> str:
    """'SIGKILL' for 9, or 'signal 77' for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def root_cause(records: list[dict[str, Any]], exits: dict[int, int], world_size: int | None = None,
               dumps: dict[int, list[Frame]] | None = None) -> dict[str, Any] | None:
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
    if exits:
        rank = min(exits)
        code = exits[rank]
        if code < 0:
            return _signal_cause(rank, code)
        return {"rank": rank, "cause": "exit", "type": "Exit", "message": f"exited with code {code}"}
    return None


def _stuck(records: list[dict[str, Any]], world_size: int | None, dumps: dict[int, list[Frame]],
           exits: dict[int, int]) -> dict[str, Any] | None:
    """The timed-out collective's verdict: who waited where, who never arrived and where each of those was.

    A rank never arrived when it left no record of its own and its stack dump (if
    any) shows it somewhere other than where the ranks that timed out waited.
    """
    timed = [r for r in records if r.get("kind") == "timeout"]
    if not timed or not world_size:
        return None
    if any(r.get("kind") == "exception" and not PEER_LOSS.search(r.get("message", "")) for r in records):
        return None
    waiting = {r["rank"]: spot_of(parse_traceback(r.get("traceback", ""))) for r in records
               if r.get("kind") == "timeout" or PEER_LOSS.search(r.get("message", ""))}
    timed_spots = [waiting[r["rank"]] for r in timed]
    common = max(set(timed_spots), key=timed_spots.count)
    recorded = {r["rank"] for r in records}
    dumped = {r: spot_of(frames) for r, frames in dumps.items() if r not in recorded}
    never = sorted(r for r in range(world_size) if r not in recorded and dumped.get(r) != common)
    if not never:
        return None
    first = min(timed, key=lambda r: r.get("time", 0.0))
    spots = {**waiting, **{r: s for r, s in dumped.items() if s == common}, **{r: dumped[r] for r in never if r in dumped}}
    stuck = {str(r): dumped[r].as_record() if r in dumped else {"frame": None, "note": "no stack dump (the rank had ended)"}
             for r in never}
    return {**first, "cause": "stuck", "missing_ranks": never, "stuck": stuck, "_spots": spots}


def _signal_cause(rank: int, exit_code: int) -> dict[str, Any]:
    name = signal_name(-exit_code)
    return {"rank": rank, "cause": "signal", "signal": name, "type": "Signal", "message": f"killed by {name}"}


def explain_failure(run_dir: Path, exits: dict[int, int], label_of: Any, coords_of: Any,
                    world_size: int | None = None, dumps: dict[int, list[Frame]] | None = None,
                    ) -> tuple[dict[str, Any], str] | None:
    """The root cause of a failed run, shaped for ``result.json``, and its summary (None: nothing explains it).

    Without ``dumps``, the last stack dump each rank left in its stacks file is used.
    """
    if dumps is None and world_size:
        dumps = read_last_dumps(run_dir, [r for r in files.rank_files(run_dir, "stacks") if r < world_size])
    cause = root_cause(load_failure_records(run_dir), exits, world_size, dumps)
    if cause is None:
        return None
    summary = failure_summary(cause, label_of, run_dir)
    cause.pop("traceback", None)
    cause.pop("_spots", None)
    for rank, entry in (cause.get("stuck") or {}).items():
        if entry.get("frame"):
            entry["dump"] = str(files.rank_stacks(run_dir, int(rank)))
    cause["coords"] = coords_of(cause["rank"])
    cause["log"] = str(files.rank_log(run_dir, cause["rank"]))
    return cause, summary


def failure_summary(cause: dict[str, Any], label_of: Any, run_dir: Path) -> str:
    """One human summary naming the rank, its coordinates, what happened and its log file."""
    rank = cause["rank"]
    log = files.rank_log(run_dir, rank)
    if cause["cause"] == "stuck":
        missing = cause["missing_ranks"]
        who = ", ".join(f"rank {m} ({label_of(m)})" for m in missing)
        lines = [f"collective timed out: {who} never arrived"]
        spots = cause.get("_spots")
        if spots:
            lines += describe_groups(group_spots(spots), label_of)
        else:
            lines.append(f"  rank {rank} ({label_of(rank)}) gave up waiting: {cause['type']}: "
                         f"{_first_line(cause['message'])}")
        lines.append(f"  logs: {', '.join(str(files.rank_log(run_dir, m)) for m in missing)}")
        dumped = [str(files.rank_stacks(run_dir, m)) for m in missing if (cause.get("stuck") or {}).get(str(m), {}).get("frame")]
        if dumped:
            lines.append(f"  stacks: {', '.join(dumped)}")
        return "\n".join(lines)
    if cause["cause"] == "signal":
        return f"rank {rank} ({label_of(rank)}) was killed by {cause['signal']}\n  log: {log}"
    return (f"rank {rank} ({label_of(rank)}) failed first: {cause['type']}: "
            f"{_first_line(cause['message'])}\n  log: {log}")


def _first_line(text: str, limit: int = 500) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."
