"""The ``ft`` section of ``result.json``, composed from what the replica groups left in their run
directories (``RUN_DIR/replicas/{k}``).

- ``recoveries``: one per restart of a replica group: ``replica``, ``rank`` (in its group; also
  ``global_rank``), ``cause`` (the signal or exit code; on Ray, which knows no exit codes,
  ``died`` for a rank that ended without a record, ``node_died``, or the error's type),
  ``failed_at_step`` (its last step before the failure), ``rejoined_at_step`` (the step it
  healed to, or of its first quorum when it came back at the quorum's step and had nothing to
  heal), ``seconds_to_rejoin`` (failure seen -> back), ``healed_from`` (the replica group
  that sent the state; null without a heal);
- ``survivor_restarts``: restarts of replica groups, not by a signal, that followed another
  group's failure within the cross-replica timeout (a cascade; the goal is 0);
- ``steps_completed``, ``stepped_back`` (a replica group whose steps ever went down) and
  ``weights_sha256`` per replica group, and whether the final weights are equal.
"""

from __future__ import annotations

import itertools
import json
import signal
from pathlib import Path
from typing import Any

from ..rundir import files
from ..rundir.failures import culprit
from ..rundir.io import read_lines, read_text
from ..rundir.record import RecordError, RunRecord

__all__ = ["compose_ft", "ft_status_lines", "last_step", "read_events", "read_steps"]

CASCADE_WINDOW_S = 5.0
"""Beyond the cross-replica timeout: a failure this soon after another group's counts as its
consequence."""
FROM_OUTSIDE = ("died", "node_died")
"""Ray's causes of a rank killed from outside (a signal, the OOM killer, a lost node): a failure
of its own, never a cascade."""


def read_steps(replica_dir: Path) -> list[tuple[float, int, int | None]]:
    """(time, step, replica groups in the quorum) of every step rank 0 of a replica group
    reported."""
    out: list[tuple[float, int, int | None]] = []
    for row in _rows(files.metrics_file(replica_dir)):
        if row.get("rank") == 0 and isinstance(row.get("step"), int):
            out.append((float(row.get("time", 0)), row["step"], row.get("replicas")))
    return out


def _rows(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file of the run (none if it is missing or unreadable)."""
    rows: list[dict[str, Any]] = []
    try:
        for line in read_lines(path):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    except (OSError, ValueError):  # missing, or not a regular file (UnreadableFile)
        pass
    return rows


def last_step(replica_dir: Path) -> int | None:
    """The last step rank 0 of a replica group reported (None before its first)."""
    steps = read_steps(replica_dir)
    return steps[-1][1] if steps else None


def read_events(replica_dir: Path) -> list[dict[str, Any]]:
    """A replica group's events (``failed`` by its agent, ``healed`` by its rank 0), in order."""
    return sorted(_rows(files.ft_events(replica_dir)), key=lambda e: e.get("time", 0))


def _cause(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def _addresses(run_dir: Path, replicas: int, ranks: int) -> dict[str, int]:
    """Each rank's healing address (of every attempt) -> its replica group."""
    out: dict[str, int] = {}
    for k in range(replicas):
        for r in range(ranks):
            try:
                text = read_text(files.ft_address(files.ft_replica_dir(run_dir, k), r))
            except (OSError, ValueError):
                continue
            out.update({line.strip(): k for line in text.splitlines() if line.strip()})
    return out


def _back_after(events: list[dict[str, Any]], i: int) -> dict[str, Any] | None:
    """How the group came back after failure ``i`` (unless another failure came first): its
    heal, else its first quorum (a group back at the quorum's step from its own checkpoint has
    nothing to heal)."""
    came_back = None
    for e in events[i + 1 :]:
        if e.get("event") == "failed":
            break
        if e.get("event") == "healed":
            return e
        if e.get("event") == "rejoined" and came_back is None:
            came_back = e
    return came_back


def _hung_before(events: list[dict[str, Any]], i: int) -> dict[str, Any] | None:
    """The launcher's hang watch's event, if it tore the group down just before failure ``i``."""
    for e in reversed(events[:i]):
        if e.get("event") == "failed":
            return None
        if e.get("event") == "hung":
            return e
    return None


def _recovery(
    k: int,
    ev: dict[str, Any],
    back: dict[str, Any] | None,
    ranks: int,
    where: dict[str, int],
    hung: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One restart of replica group ``k``: who failed, how, and how it came back (a group the
    hang watch tore down: the rank it found stopped, else the first it found stuck in a step)."""
    codes = {int(r): int(c) for r, c in (ev.get("exit_codes") or {}).items()}
    found = culprit(codes) if codes else ev.get("rank")  # a launcher without exit codes: Ray
    rank = -1 if found is None else int(found)
    named = (hung.get("stopped") or hung.get("stuck")) if hung is not None else None
    if named:
        rank = int(named[0])
    came = back or {}
    healed = came.get("event") == "healed"
    cause = _cause(codes[rank]) if rank in codes else str(ev.get("cause") or "unknown")
    return {
        "replica": k,
        "rank": rank,
        "global_rank": k * ranks + rank if rank >= 0 else None,
        "cause": "hang" if hung is not None else cause,
        "failed_at_step": ev.get("failed_at_step"),
        "failed_at": ev["time"],
        "rejoined_at_step": came.get("step"),
        "seconds_to_rejoin": round(came["time"] - ev["time"], 3) if back else None,
        "healed_from": where.get(str(came.get("source"))) if healed else None,
    }


def _recoveries(run_dir: Path, k: int, ranks: int, where: dict[str, int]) -> list[dict[str, Any]]:
    """Replica group ``k``'s restarts, each with how it came back (the first heal or quorum
    after it)."""
    events = read_events(files.ft_replica_dir(run_dir, k))
    return [
        _recovery(k, ev, _back_after(events, i), ranks, where, _hung_before(events, i))
        for i, ev in enumerate(events)
        if ev.get("event") == "failed"
    ]


def _survivor_restarts(recoveries: list[dict[str, Any]], window_s: float) -> int:
    """Restarts that followed another replica group's failure within ``window_s`` and were not
    caused by a signal (a rank killed from outside is a failure of its own, not a cascade)."""
    n = 0
    for rec in recoveries:
        if str(rec.get("cause", "")).startswith("SIG") or rec.get("cause") in FROM_OUTSIDE:
            continue
        if any(
            o["replica"] != rec["replica"] and 0 < rec["failed_at"] - o["failed_at"] <= window_s
            for o in recoveries
        ):
            n += 1
    return n


def _replica_record(run_dir: Path, k: int) -> RunRecord | None:
    try:
        return RunRecord.read(files.ft_replica_dir(run_dir, k))
    except RecordError:
        return None


def _steps(run_dir: Path, k: int, recoveries: list[dict[str, Any]]) -> tuple[int, bool]:
    """Replica group ``k``'s last step, and whether it ever stepped back without a restart."""
    steps = [s for _, s, _ in read_steps(files.ft_replica_dir(run_dir, k))]
    restarted = any(r["replica"] == k for r in recoveries)
    back = not restarted and any(b <= a for a, b in itertools.pairwise(steps))
    return (steps[-1] if steps else 0), back


def _failure(k: int, rec: RunRecord | None) -> dict[str, Any]:
    inner = (rec.failure if rec is not None else None) or {}
    return {
        **inner,
        "replica": k,
        "message": f"replica group {k} failed: {inner.get('message', 'no record')}",
    }


def compose_ft(
    run_dir: Path, ft: Any, ranks: int, exit_codes: dict[int, int | None]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the ``ft`` section, the record's other facts: results by global rank, failure)."""
    where = _addresses(run_dir, ft.replicas, ranks)
    recoveries: list[dict[str, Any]] = []
    for k in range(ft.replicas):
        recoveries += _recoveries(run_dir, k, ranks, where)
    results: dict[str, Any] = {}
    steps_completed, stepped_back, weights = {}, {}, {}
    failures = []
    for k in range(ft.replicas):
        steps_completed[str(k)], stepped_back[str(k)] = _steps(run_dir, k, recoveries)
        rec = _replica_record(run_dir, k)
        ranks_results = rec.results if rec is not None else {}
        for r, value in ranks_results.items():
            results[str(k * ranks + int(r))] = value
        weights[str(k)] = (ranks_results.get("0") or {}).get("weights_sha256")
        if exit_codes.get(k, 0) != 0:  # None: the group left no exit code (a lost node)
            failures.append(_failure(k, rec))
    window = float(ft.timeout_s) + float(ft.heartbeat_timeout_s) + CASCADE_WINDOW_S
    section = {
        "replicas": ft.replicas,
        "min_replicas": ft.min_replicas,
        "recoveries": recoveries,
        "survivor_restarts": _survivor_restarts(recoveries, window),
        "steps_completed": steps_completed,
        "stepped_back": stepped_back,
        "weights_sha256": weights,
        "weights_equal": len(set(weights.values())) == 1 and None not in weights.values(),
        "exit_codes": {str(k): c for k, c in exit_codes.items()},
    }
    facts: dict[str, Any] = {"results": results}
    if failures:
        facts["failure"] = failures[0]
    return section, facts


def _healing(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The heal under way: a ``healing`` event with no ``healed`` or ``failed`` after it."""
    last = next((e for e in reversed(events) if e.get("event") != "rejoined"), None)
    return last if last is not None and last.get("event") == "healing" else None


def _group_line(replica_dir: Path, k: int, where_from: dict[str, int]) -> str:
    steps = read_steps(replica_dir)
    events = read_events(replica_dir)
    failures = [i for i, e in enumerate(events) if e.get("event") == "failed"]
    where = f"step {steps[-1][1]}" if steps else "not stepping yet"
    if steps and steps[-1][2] is not None:
        where += f", quorum of {steps[-1][2]} replica group(s)"
    back = _back_after(events, failures[-1] if failures else -1)
    healing = _healing(events)
    if healing is not None:
        source = where_from.get(str(healing.get("source")))
        peer = f"replica group {source}" if source is not None else "a peer"
        where += f" - healing from {peer} to step {healing.get('step')}"
    elif failures and back is None:
        failed_at = events[failures[-1]].get("failed_at_step")
        where += f" - restarting after a failure at step {failed_at}, to heal"
    elif back is not None and back.get("event") == "healed":
        where += f" - healed to step {back.get('step')}"
    elif back is not None:
        where += f" - back at step {back.get('step')} from its own checkpoint (nothing to heal)"
    if failures:
        where += f" ({len(failures)} restart(s))"
    return f"replica group {k}: {where}"


def ft_status_lines(run_dir: Path) -> list[str]:
    """Under ``ft=torchft``: each replica group's step, the quorum it stepped in, and whether it is
    restarting, healing or healed (``status`` shows them)."""
    root = files.ft_replica_dir(run_dir, 0).parent
    if not root.is_dir():
        return []
    groups = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())
    logs = [files.ft_address(files.ft_replica_dir(run_dir, k), 0).parent for k in groups]
    ranks = max((len(list(d.glob("rank*.ft_address"))) for d in logs), default=0)
    where_from = _addresses(run_dir, max(groups, default=-1) + 1, ranks)
    return [_group_line(files.ft_replica_dir(run_dir, k), k, where_from) for k in groups]
