"""Turning what the ranks left behind into one verdict: status, root cause, summary."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

from . import rundir

__all__ = ["PEER_LOSS", "explain_failure", "failure_summary", "load_failure_records", "root_cause", "signal_name"]

PEER_LOSS = re.compile(r"connection closed by peer|connection reset|broken pipe|"
                       r"ProcessGroup.*abort|NCCL communicator was aborted", re.IGNORECASE)


def load_failure_records(run_dir: Path) -> list[dict[str, Any]]:
    """The failure records of the last attempt (restarts leave older ones behind), oldest first."""
    records = []
    for path in sorted((Path(run_dir) / rundir.LOGS).glob("rank*.error.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    last = max((r.get("attempt", 0) for r in records), default=0)
    return sorted((r for r in records if r.get("attempt", 0) == last), key=lambda r: r.get("time", 0.0))


def signal_name(signum: int) -> str:
    """'SIGKILL' for 9, or 'signal 77' for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def root_cause(records: list[dict[str, Any]], exits: dict[int, int]) -> dict[str, Any] | None:
    """Pick the failure that explains the run.

    ``exits`` maps ranks that ended badly to their exit code, read as the failure
    was seen; negative means killed by that signal. SIGTERM is how the agent
    stops the survivors, so it names no cause. Order of preference: ranks a
    timed-out collective waited for; a rank killed by another signal (it cannot
    leave a record, and its peers' errors are consequences); the first rank that
    raised on its own; the first rank that lost a peer; any non-zero exit.
    """
    for rec in records:
        if rec.get("kind") == "timeout" and rec.get("missing_ranks"):
            return {**rec, "cause": "stuck"}
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


def _signal_cause(rank: int, exit_code: int) -> dict[str, Any]:
    name = signal_name(-exit_code)
    return {"rank": rank, "cause": "signal", "signal": name, "type": "Signal", "message": f"killed by {name}"}


def explain_failure(run_dir: Path, exits: dict[int, int], label_of: Any,
                    coords_of: Any) -> tuple[dict[str, Any], str] | None:
    """The root cause of a failed run, shaped for ``result.json``, and its summary (None: nothing explains it)."""
    cause = root_cause(load_failure_records(run_dir), exits)
    if cause is None:
        return None
    summary = failure_summary(cause, label_of, run_dir)
    cause.pop("traceback", None)
    cause["coords"] = coords_of(cause["rank"])
    cause["log"] = str(rundir.rank_log(run_dir, cause["rank"]))
    return cause, summary


def failure_summary(cause: dict[str, Any], label_of: Any, run_dir: Path) -> str:
    """One human summary naming the rank, its coordinates, what happened and its log file."""
    rank = cause["rank"]
    log = rundir.rank_log(run_dir, rank)
    if cause["cause"] == "stuck":
        missing = cause["missing_ranks"]
        who = ", ".join(f"rank {m} ({label_of(m)})" for m in missing)
        return (f"collective timed out: {who} never arrived; rank {rank} ({label_of(rank)}) gave up "
                f"waiting: {cause['type']}: {_first_line(cause['message'])}\n"
                f"  logs: {', '.join(str(rundir.rank_log(run_dir, m)) for m in missing)}")
    if cause["cause"] == "signal":
        return f"rank {rank} ({label_of(rank)}) was killed by {cause['signal']}\n  log: {log}"
    return (f"rank {rank} ({label_of(rank)}) failed first: {cause['type']}: "
            f"{_first_line(cause['message'])}\n  log: {log}")


def _first_line(text: str, limit: int = 500) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."
