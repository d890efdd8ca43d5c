"""What the tools ask about a Ray run: its state, its end, cancelling it, reaching its ranks.

A run lives while its monitor does (the launching command holding the run directory's lock, or
the supervisor actor); one whose monitor is gone without a final record ended ``unknown``."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...rundir.claim import launch_alive
from ...rundir.outcome import RunOutcome
from ...rundir.record import RecordError, RunRecord, Status
from . import ray_adapter as rt
from . import state
from .cluster import alive_nodes
from .rank_entry import kill_raylet
from .rank_entry import signal_ranks as reach


def _final(run_dir: Path) -> RunOutcome | None:
    try:
        record = RunRecord.read(run_dir)
    except RecordError:
        return None
    return RunOutcome.of(record, Path(run_dir)) if record is not None and record.final else None


def _join(info: dict[str, Any]) -> None:
    """Connect this process to the run's cluster (once; it stays, e.g. for ``status --follow``)."""
    if not rt.is_connected():
        if info.get("token_file"):  # a private instance: its own token, in its owner-only dir
            token = {"RAY_AUTH_TOKEN_PATH": str(info["token_file"]), "RAY_AUTH_TOKEN": None}
            rt.set_env({"RAY_AUTH_MODE": "token", **token})
        rt.join_cluster(str(info["address"]))
        rt.route_cluster_messages(lambda line: None)


@contextlib.contextmanager
def _joined(info: dict[str, Any]) -> Iterator[None]:
    """Connected to the run's cluster for one action (left again if this connected)."""
    connected = rt.is_connected()
    _join(info)
    try:
        yield
    finally:
        if not connected:
            rt.shutdown()


def supervisor(run_dir: Path) -> Any | None:
    """The run's live supervisor actor (None: the run has none, or it is gone)."""
    info = state.read(run_dir) or {}
    if not info.get("supervisor") or not info.get("address"):
        return None
    _join(info)
    return rt.actor_by_name(str(info["supervisor"]), str(info.get("namespace") or ""))


def monitor_alive(run_dir: Path) -> bool:
    """Whether what monitors the run (the launching command, or the supervisor) still lives."""
    if (state.read(run_dir) or {}).get("supervisor"):
        try:
            return supervisor(run_dir) is not None
        except Exception:
            return True  # the cluster does not answer: it may still run there
    return launch_alive(run_dir)


def live_state(run_dir: Path) -> tuple[str, str] | None:
    """('Ray run wf_launch.x.3f2a', 'RUNNING attempt 0 on 2 node(s)'); None without a record."""
    info = state.read(run_dir)
    if not info:
        return None
    word = str(info.get("state") or "not started").upper()
    nodes = {p.get("node") for p in (info.get("placement") or {}).values() if isinstance(p, dict)}
    attempt = info.get("attempt") is not None and word != "SUBMITTED"
    text = word + (f" attempt {info['attempt']}" if attempt else "")
    text += f" on {len(nodes)} node(s)" if nodes and word == "RUNNING" else ""
    return f"Ray run {info.get('supervisor') or Path(run_dir).name}", text


def status(run_dir: Path) -> tuple[str, RunOutcome | None]:
    """The run's state, and its final outcome once it ended ('unknown': its monitor vanished)."""
    run_dir = Path(run_dir)
    final = _final(run_dir)
    if final is not None:
        return "ENDED", final
    info = state.read(run_dir)
    if not info:
        return "NOT STARTED", None
    try:
        alive = monitor_alive(run_dir)
    except Exception as exc:
        return f"UNREACHABLE ({type(exc).__name__}: {exc})", None
    if alive:
        return (live_state(run_dir) or ("", ""))[1], None
    final = _final(run_dir)  # it may have ended while we asked
    if final is not None:
        return "ENDED", final
    who = f"supervisor actor {info['supervisor']}" if info.get("supervisor") else None
    summary = (
        f"the run's {who or 'launching command'} is gone and left no final record; its outcome "
        "is unknown (its ranks and placement group went with it)"
    )
    if who is None:
        return "GONE", RunOutcome(Status.UNKNOWN, run_dir, summary)
    failure = {"cause": "unknown", "message": summary}
    record = RunRecord.finalize(run_dir, Status.UNKNOWN, launcher="ray", failure=failure)
    return "GONE", RunOutcome.of(record, run_dir, summary)


def cancel(run_dir: Path, wait_s: float = 60.0) -> str | None:
    """Stop the run: its supervisor cancels it (SIGTERM to the ranks, then 'cancelled'); the
    launching command of a watched run gets SIGTERM. What was cancelled (None: nothing runs)."""
    run_dir = Path(run_dir)
    info = state.read(run_dir) or {}
    if _final(run_dir) is not None:
        return None
    if not info.get("supervisor"):
        pid = int(info.get("launcher_pid") or 0)
        if pid and info.get("launcher_host") == socket.gethostname() and launch_alive(run_dir):
            os.kill(pid, signal.SIGTERM)
            return f"launching command (pid {pid})"
        return None
    actor = supervisor(run_dir)
    if actor is None:
        return None
    try:
        rt.get(actor.cancel.remote(), 30.0)
    except Exception:
        rt.kill(actor)
    deadline = time.monotonic() + wait_s
    while _final(run_dir) is None and time.monotonic() < deadline:
        time.sleep(0.3)
    if _final(run_dir) is None:
        rt.kill(actor)  # it did not finish in time: its ranks and placement group go with it
        message = f"cancelled; the supervisor did not finish within {wait_s:g} s and was killed"
        failure = {"cause": "cancelled", "message": message}
        RunRecord.finalize(run_dir, Status.CANCELLED, launcher="ray", failure=failure)
    return str(info["supervisor"])


def signal_ranks(run_dir: Path, signum: int, only: int | None = None) -> set[int]:
    """Send ``signum`` to every rank (``only``: that one) of the current attempt; those reached."""
    info = state.read(run_dir) or {}
    where = state.where_of(run_dir)
    if only is not None:
        where = {only: where[only]} if only in where else {}
    if not where or not info.get("address") or (only is None and _final(run_dir) is not None):
        return set()
    with _joined(info):
        return reach(run_dir, where, signum)


def kill_node(run_dir: Path, rank: int) -> str:
    """Kill the raylet of the node that runs ``rank`` (the drill's nodekill; not the head's or
    this process's node); what was killed."""
    info = state.read(run_dir) or {}
    placement = state.placement_of(run_dir)
    if rank not in placement or not info.get("address"):
        raise ValueError(f"rank {rank} has no recorded placement in {run_dir}")
    node = str(placement[rank]["node"])
    with _joined(info):
        if node in {n.node_id for n in alive_nodes() if n.head} or node == rt.current_node_id():
            raise ValueError(
                f"rank {rank} runs on node {node[:12]}, the cluster's head (or this process's "
                "node): nodekill needs a rank on another node"
            )
        pid = kill_raylet(run_dir, rank, node)
    return f"raylet pid {pid} of node {node[:12]} (rank {rank}'s)"
