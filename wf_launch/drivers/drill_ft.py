"""The drill under ``ft=torchft``: kill a rank of one replica group, check the others never noticed.

``python -m wf_launch.drill task=train ft=torchft ft.replicas=2 ... --inject kill9:replica1@8``

1. The *reference*: the same ft run, uninterrupted, in ``DIR/reference``.
2. The *interrupted* run in ``DIR/interrupted``: when replica group K's rank 0 reports step S,
   ``kill -9`` one of its ranks (``kill9:replicaK@S`` its last rank, ``kill9:replicaK.rankR@S``
   rank R); ``kill9:replicaK@heal``, after a kill of that group, kills it again while it heals
   (once its rank 0 has started receiving a peer's state); ``hang:replicaK@S`` stops the rank
   (SIGSTOP) instead: the launcher's hang watch must find the group and restart it.
   ``ft.max_replica_restarts`` is raised to the number of injections.
3. The verdict (exit 0 only when every check holds):

   - no surviving replica group restarted (its ranks kept their pids, ``survivor_restarts`` 0)
     or stepped back (its steps only go up);
   - every failed replica group rejoined (healed from a live peer);
   - every replica group ends with bitwise-identical weights;
   - rank 0's final loss is within ``--atol`` (default :data:`DEFAULT_ATOL`) of the reference's:
     for the steps a replica group is missing, the gradient is averaged over fewer replica groups
     (and so over fewer samples), so the numbers differ a little; the drill reports by how much.

It prints the seconds each failed replica group took to rejoin, the steps the survivors lost
(the goal is 0) and the steps the failed replica group missed. ``DIR/drill.json`` keeps it all.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..launchers.ft_record import read_events, read_steps
from ..launchers.registry import get_launcher
from ..rundir import files
from ..rundir.io import atomic_write_json, read_json
from ..rundir.pids import live_rank_pid
from ..rundir.record import RecordError, RunRecord
from .drill_launch import launch_cli

__all__ = [
    "DEFAULT_ATOL",
    "FtDrillError",
    "FtInjection",
    "describe_ft_drill",
    "parse_ft_injections",
    "render",
    "run_ft_drill",
    "verdict",
    "wants_ft",
]

DEFAULT_ATOL = 0.05
_SPEC = re.compile(
    r"(?P<kind>[a-z0-9]+):replica(?P<replica>\d+)(?:\.rank(?P<rank>\d+))?@(?P<step>\d+|heal)"
)
KINDS = ("kill9", "hang")
ACTS = {"kill9": (signal.SIGKILL, "kill -9"), "hang": (signal.SIGSTOP, "SIGSTOP (a hang)")}
"""What each kind does to the rank: a death, or a hang it cannot even report (the launcher's hang
watch must find it: ``ft.hang_timeout_s``)."""


class FtDrillError(Exception):
    """The ft drill could not do what it was asked."""


@dataclass
class FtInjection:
    """``kill9`` of a rank of replica group ``replica`` when it reaches ``step``; with ``heal``,
    while it heals after the injection before it (``step`` is then that injection's)."""

    kind: str
    replica: int
    step: int
    rank: int | None = None
    heal: bool = False
    pid: int | None = None
    at: float | None = None


def wants_ft(overrides: list[str]) -> bool:
    """Whether the drilled run is an ``ft=torchft`` run."""
    return any(o.strip() in ("ft=torchft", "+ft=torchft") for o in overrides)


def _parse_one(item: str, replicas: int, earlier: list[FtInjection]) -> FtInjection:
    m = _SPEC.fullmatch(item)
    if m is None:
        raise FtDrillError(
            f"--inject {item!r}: expected KIND:replicaK@STEP, KIND:replicaK.rankR@STEP or "
            f"KIND:replicaK@heal under ft=torchft (KIND one of {list(KINDS)})"
        )
    if m["kind"] not in KINDS:
        raise FtDrillError(
            f"--inject {item!r}: {m['kind']} is not drilled under ft=torchft on this "
            f"launcher; one of {list(KINDS)}"
        )
    replica = int(m["replica"])
    if not 0 <= replica < replicas:
        raise FtDrillError(
            f"--inject {item!r}: replica{replica} does not exist: ft.replicas={replicas} "
            f"(replica0..replica{replicas - 1})"
        )
    rank = int(m["rank"]) if m["rank"] is not None else None
    if m["step"] != "heal":
        return FtInjection(m["kind"], replica, int(m["step"]), rank)
    before = [i for i in earlier if i.replica == replica and not i.heal]
    if not before:
        raise FtDrillError(
            f"--inject {item!r}: @heal kills replica{replica} while it heals after a failure; "
            f"list a kill of replica{replica} at a step before it (kill9:replica{replica}@STEP)"
        )
    return FtInjection(m["kind"], replica, before[-1].step, rank, heal=True)


def parse_ft_injections(text: str, replicas: int) -> list[FtInjection]:
    """``kill9:replica1@8`` (``kill9:replica1.rank0@8``, ``kill9:replica1@heal``) -> injections
    in step order (a heal's after the kill it follows)."""
    out: list[FtInjection] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        out.append(_parse_one(item, replicas, out))
    if not out:
        raise FtDrillError("--inject: no injection given")
    return sorted(out, key=lambda i: (i.step, i.heal))


def _wait(proc: subprocess.Popen[bytes], deadline: float) -> int:
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise FtDrillError("a run took longer than --timeout; it was killed") from None


def _pids(run_dir: Path, replica: int) -> dict[int, int]:
    """Rank -> pid of every rank of a replica group that has recorded one."""
    logs = files.rank_log(files.ft_replica_dir(run_dir, replica), 0).parent
    out = {}
    for path in logs.glob("rank*.pid"):
        try:
            out[int(path.name[4:].split(".")[0])] = int(read_json(path)["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _reached(where: Path, inj: FtInjection, since: float) -> bool:
    """Whether the replica group is where the injection strikes: its step, or a heal begun since."""
    if inj.heal:
        return any(
            e.get("event") == "healing" and e.get("time", 0) > since for e in read_events(where)
        )
    return max((s for _, s, _ in read_steps(where)), default=0) >= inj.step


def _send_here(replica_dir: Path, rank: int, pid: int, signum: int) -> None:
    os.kill(pid, signum)


def _sender(backend: str) -> Any:
    """How the drill signals a rank: ``os.kill`` when it runs on this host, else through the
    launcher (Ray: to whichever node runs it)."""
    if backend == "local":
        return _send_here
    launcher = get_launcher(backend)

    def send(replica_dir: Path, rank: int, pid: int, signum: int) -> None:
        if live_rank_pid(replica_dir, rank) == pid:
            os.kill(pid, signum)
        elif not launcher.signal_rank(replica_dir, rank, signum):
            raise FtDrillError(f"rank {rank} of {replica_dir} could not be reached")

    return send


def _inject(
    proc: subprocess.Popen[bytes],
    run_dir: Path,
    inj: FtInjection,
    deadline: float,
    since: float = 0.0,
    send: Any = _send_here,
) -> None:
    """Wait until the replica group reaches the step (or heals after ``since``), then kill -9 the
    rank (or stop it: a hang)."""
    where = files.ft_replica_dir(run_dir, inj.replica)
    moment = "a heal" if inj.heal else f"step {inj.step}"
    while not _reached(where, inj, since):
        if proc.poll() is not None:
            raise FtDrillError(f"the run ended before replica{inj.replica} reached {moment}")
        if time.monotonic() > deadline:
            raise FtDrillError(f"replica{inj.replica} never reached {moment}")
        time.sleep(0.02)
    pids = _pids(run_dir, inj.replica)
    inj.rank = max(pids) if inj.rank is None else inj.rank
    inj.pid, inj.at = pids[inj.rank], time.time()
    signum, act = ACTS[inj.kind]
    send(where, inj.rank, inj.pid, signum)
    print(
        f"drill: {act} rank {inj.rank} of replica{inj.replica} (pid {inj.pid}) "
        f"{'while it heals' if inj.heal else f'at step {inj.step}'}",
        flush=True,
    )


def _record(run_dir: Path) -> RunRecord | None:
    try:
        return RunRecord.read(run_dir)
    except RecordError:
        return None


def _final_loss(rec: RunRecord | None) -> float | None:
    value = ((rec.results if rec is not None else {}).get("0") or {}).get("final_loss")
    return float(value) if isinstance(value, (int, float)) else None


def _checks(
    reference: RunRecord | None,
    interrupted: RunRecord | None,
    ft: dict[str, Any],
    failed: set[int],
    survivors: dict[int, tuple[dict[int, int], dict[int, int]]],
) -> dict[str, bool]:
    recoveries = ft.get("recoveries") or []
    both_ok = reference is not None and interrupted is not None
    return {
        "runs_ok": both_ok and reference.status == interrupted.status == "ok",
        "survivors_kept_pids": all(before == after for before, after in survivors.values()),
        "survivors_never_restarted": ft.get("survivor_restarts") == 0
        and not any(r["replica"] not in failed for r in recoveries),
        "survivors_never_stepped_back": not any((ft.get("stepped_back") or {}).values()),
        "failed_replicas_rejoined": all(
            any(r["replica"] == k and r.get("rejoined_at_step") is not None for r in recoveries)
            for k in failed
        ),
        "weights_identical": ft.get("weights_equal") is True,
    }


def _missed(rec: dict[str, Any]) -> int | None:
    """Steps a failed replica group did not train: from its failure to the step it healed to."""
    if rec.get("rejoined_at_step") is None or rec.get("failed_at_step") is None:
        return None
    return int(rec["rejoined_at_step"]) - int(rec["failed_at_step"])


def verdict(
    reference: RunRecord | None,
    interrupted: RunRecord | None,
    injections: list[FtInjection],
    survivors: dict[int, tuple[dict[int, int], dict[int, int]]],
    atol: float,
) -> dict[str, Any]:
    """The checks and figures of the drill (see the module's docstring)."""
    ft = (interrupted.extra.get("ft") if interrupted is not None else None) or {}
    recoveries = ft.get("recoveries") or []
    checks = _checks(reference, interrupted, ft, {i.replica for i in injections}, survivors)
    ref_loss, int_loss = _final_loss(reference), _final_loss(interrupted)
    diff = abs(ref_loss - int_loss) if ref_loss is not None and int_loss is not None else None
    checks["loss_within_atol"] = diff is not None and diff <= atol
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "atol": atol,
        "final_loss": {"reference": ref_loss, "interrupted": int_loss, "abs_diff": diff},
        "seconds_to_rejoin": [r.get("seconds_to_rejoin") for r in recoveries],
        "survivor_steps_lost": 0 if checks["survivors_never_stepped_back"] else None,
        "failed_replica_steps_missed": [_missed(r) for r in recoveries],
        "recoveries": recoveries,
        "injections": [asdict(i) for i in injections],
    }


def render(summary: dict[str, Any]) -> str:
    """The verdict as the lines the drill prints."""
    lines = [f"ft drill: {'PASS' if summary['ok'] else 'FAIL'}"]
    lines += [f"  {'ok  ' if v else 'FAIL'} {k}" for k, v in summary["checks"].items()]
    loss = summary["final_loss"]
    lines.append(
        f"  final loss: reference {loss['reference']}, interrupted {loss['interrupted']}, "
        f"|diff| {loss['abs_diff']} (atol {summary['atol']})"
    )
    lines.append(f"  seconds to rejoin: {summary['seconds_to_rejoin']}")
    lines.append(f"  steps lost by the survivors: {summary['survivor_steps_lost']}")
    lines.append(
        f"  steps the failed replica group missed: {summary['failed_replica_steps_missed']}"
    )
    return "\n".join(lines)


def _replicas(overrides: list[str]) -> int:
    for o in overrides:
        if o.startswith("ft.replicas="):
            return int(o.split("=", 1)[1])
    return 2


def describe_ft_drill(overrides: list[str], inject: str) -> str:
    """The plan of the drill (``--dry-run``): the two runs and the kills; raises on bad input."""
    injections = parse_ft_injections(inject, _replicas(overrides))
    lines = [
        "ft drill: a reference run, then the same run with:",
        *(
            f"  {ACTS[i.kind][1]} of {'the last rank' if i.rank is None else f'rank {i.rank}'} of "
            f"replica{i.replica} "
            + ("while it heals after that" if i.heal else f"at its step {i.step}")
            for i in injections
        ),
        f"  overrides: {' '.join(overrides)} ft.max_replica_restarts={len(injections)}",
    ]
    return "\n".join(lines)


def run_ft_drill(
    overrides: list[str],
    inject: str,
    directory: Path,
    timeout: float,
    atol: float | None,
    backend: str = "local",
) -> int:
    """Both runs and the verdict; the exit code (0: every check holds, 1: one does not)."""
    injections = parse_ft_injections(inject, _replicas(overrides))
    overrides = [f"launcher={backend}", *overrides]
    send = _sender(backend)
    directory.mkdir(parents=True, exist_ok=True)
    ref_dir, int_dir = directory / "reference", directory / "interrupted"
    deadline = time.monotonic() + timeout
    print(f"drill: reference run in {ref_dir}", flush=True)
    _wait(launch_cli(overrides, ref_dir, directory / "reference.log"), deadline)
    deadline = time.monotonic() + timeout
    kills = len(injections)
    extra = [f"ft.max_replica_restarts={kills}"]
    print(f"drill: interrupted run in {int_dir}", flush=True)
    proc = launch_cli([*overrides, *extra], int_dir, directory / "interrupted.log")
    survivors: dict[int, tuple[dict[int, int], dict[int, int]]] = {}
    try:
        for inj in injections:
            since = max((i.at or 0.0 for i in injections if i.replica == inj.replica), default=0)
            _inject(proc, int_dir, inj, deadline, since, send)
            for k in range(_replicas(overrides)):
                if k not in {i.replica for i in injections} and k not in survivors:
                    survivors[k] = (_pids(int_dir, k), {})
        _wait(proc, deadline)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    survivors = {k: (before, _pids(int_dir, k)) for k, (before, _) in survivors.items()}
    summary = verdict(
        _record(ref_dir),
        _record(int_dir),
        injections,
        survivors,
        DEFAULT_ATOL if atol is None else atol,
    )
    atomic_write_json(directory / "drill.json", summary)
    print(render(summary), flush=True)
    return 0 if summary["ok"] else 1
