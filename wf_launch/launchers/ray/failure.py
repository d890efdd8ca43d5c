"""How an attempt of a Ray run ended: each rank's :class:`Outcome`, and the root cause.

In order: a dead node (every rank on it named), a rank that died without a record (``kill -9``,
the OOM killer, a crash), then what the ranks recorded (``explain_failure``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...observe.rootcause import death_of, explain_failure
from ...observe.stacks import Frame, rank_ranges
from ...rundir import files
from ...rundir.failures import load_failure_records
from ...rundir.record import Status


@dataclass(frozen=True)
class Outcome:
    """How one rank's ``run`` call ended (``kind``), and Ray's message when it did not return."""

    kind: str
    message: str = ""


@dataclass(frozen=True)
class Verdict:
    """A failed attempt: its root cause (``result.json``), summary, and how the attempt ended."""

    cause: dict[str, Any]
    summary: str
    ended_by: str
    status: Status = Status.FAILED


def node_text(where: dict[str, Any] | None) -> str:
    """'node 5bc47700df44, host vm' for messages."""
    where = where or {}
    return f"node {str(where.get('node') or '?')[:12]}, host {where.get('host') or '?'}"


@dataclass
class FailureContext:
    """What :func:`explain` needs to know about the run."""

    run_dir: Path
    world_size: int
    label: Callable[[int], str]
    coords: Callable[[int], dict[str, int]]
    where: dict[int, dict[str, Any]]
    node_alive: Callable[[str], bool]
    attempt: int = 0

    def label_at(self, rank: int) -> str:
        return f"{self.label(rank)} on {node_text(self.where.get(rank))}"

    def cause(self, rank: int, cause: str, kind: str, message: str) -> dict[str, Any]:
        """A failure record of ``rank``: its coordinates, node, host, pid and log."""
        w = self.where.get(rank) or {}
        log = str(files.rank_log(self.run_dir, rank))
        where = {"node": w.get("node"), "host": w.get("host"), "pid": w.get("pid"), "log": log}
        return {
            "rank": rank,
            "coords": self.coords(rank),
            **where,
            "cause": cause,
            "type": kind,
            "message": message,
        }


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[0][:300] if lines else ""


def _error_line(text: str) -> str:
    """The exception line of Ray's error text ('ValueError: ...'), else its first line."""
    lines = [ln.rstrip() for ln in (text or "").splitlines() if ln.strip()]
    plain = [
        ln for ln in lines if not ln[:1].isspace() and not ln.startswith(("Traceback", "\x1b["))
    ]
    return (plain[-1] if plain else _first_line(text))[:500]


def _nodes_of(ctx: FailureContext, ranks: list[int]) -> list[str]:
    return list(dict.fromkeys(str(ctx.where[r].get("node")) for r in ranks if ctx.where.get(r)))


def _node_died(ctx: FailureContext, node: str) -> Verdict:
    ranks = sorted(r for r, w in ctx.where.items() if w.get("node") == node)
    w = ctx.where[ranks[0]]
    message = (
        f"node {node[:12]} (host {w.get('host')}, {w.get('ip')}) died: its raylet stopped "
        f"answering; rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)} ran on it"
    )
    who = ", ".join(f"rank {r} ({ctx.label(r)})" for r in ranks[:8])
    summary = (
        f"{message}\n  {who}{' ...' if len(ranks) > 8 else ''}\n"
        f"  log: {files.rank_log(ctx.run_dir, ranks[0])}"
    )
    cause = ctx.cause(ranks[0], "node_died", "NodeDied", message)
    cause.update(ranks=ranks, ip=w.get("ip"))
    return Verdict(cause, summary, f"node {node[:12]} died")


def _rank_died(ctx: FailureContext, rank: int, ray_message: str) -> Verdict:
    how = death_of(ctx.run_dir, rank)
    summary = (
        f"rank {rank} ({ctx.label_at(rank)}) died: {how}\n"
        f"  Ray: {_first_line(ray_message)}\n  log: {files.rank_log(ctx.run_dir, rank)}"
    )
    cause = ctx.cause(rank, "died", "RankDied", f"rank {rank} died: {how}")
    cause["ray"] = _first_line(ray_message)
    return Verdict(cause, summary, f"rank {rank} died on {node_text(ctx.where.get(rank))}")


def _recorded(
    ctx: FailureContext, outcomes: dict[int, Outcome], dumps: dict[int, list[Frame]] | None
) -> Verdict:
    explained = explain_failure(ctx.run_dir, {}, ctx.label_at, ctx.coords, ctx.world_size, dumps)
    if explained is None:
        rank = min(r for r, o in outcomes.items() if o.kind not in ("ok", "preempted"))
        message = _error_line(outcomes[rank].message) or "no rank left a failure record"
        cause = ctx.cause(rank, "unknown", "Unknown", message)
        summary = f"rank {rank} ({ctx.label_at(rank)}) failed: {message}"
        return Verdict(cause, summary, f"rank {rank} failed")
    cause, summary = explained
    w = ctx.where.get(int(cause["rank"])) or {}
    cause.update(node=w.get("node"), host=w.get("host"), pid=w.get("pid", cause.get("pid")))
    what = (
        "collective timed out"
        if cause.get("cause") == "stuck"
        else f"rank {cause['rank']} failed: {cause.get('type')}"
    )
    return Verdict(cause, summary, what)


def explain(
    ctx: FailureContext,
    outcomes: dict[int, Outcome],
    pending: list[int],
    dumps: dict[int, list[Frame]] | None = None,
) -> Verdict:
    """The root cause of a failed attempt (``pending``: the ranks that did not end)."""
    setup = [r for r, o in sorted(outcomes.items()) if o.kind == "runtime_env"]
    if setup:
        message = "launcher.runtime_env could not be set up: "
        message += _first_line(outcomes[setup[0]].message)
        cause = ctx.cause(setup[0], "invalid_config", "RuntimeEnvSetupError", message)
        return Verdict(cause, cause["message"], "launcher.runtime_env failed", Status.INVALID)
    lost = [r for r, o in sorted(outcomes.items()) if o.kind in ("died", "unavailable")]
    dead = [n for n in _nodes_of(ctx, lost + pending) if not ctx.node_alive(n)]
    if dead:
        return _node_died(ctx, dead[0])
    recorded = {
        int(r["rank"])
        for r in load_failure_records(ctx.run_dir)
        if r.get("attempt", 0) == ctx.attempt
    }
    silent = [r for r in lost if r not in recorded]
    if silent:
        return _rank_died(ctx, silent[0], outcomes[silent[0]].message)
    return _recorded(ctx, outcomes, dumps)
