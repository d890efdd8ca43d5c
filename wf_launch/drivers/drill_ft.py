"""The drill under ``ft=torchft``: kill a rank of one replica group, check the others never noticed.

``python -m wf_launch.drill task=train ft=torchft ft.replicas=2 ... --inject kill9:replica1@8``

1. The *reference*: the same ft run, uninterrupted, in ``DIR/reference`` (skipped with
   ``--no-reference``: the loss check below is then left out, the others stand on the
   interrupted run alone).
2. The *interrupted* run in ``DIR/interrupted``: when replica group K's rank 0 reports step S,
   ``kill -9`` one of its ranks (``kill9:replicaK@S`` its last rank, ``kill9:replicaK.rankR@S``
   rank R); ``kill9:replicaK@heal``, after a kill of that group, kills it again while it heals
   (once its rank 0 has started receiving a peer's state); ``hang:replicaK@S`` stops the rank
   (SIGSTOP) instead: the launcher's hang watch must find the group and restart it;
   ``nodekill:replicaK@S`` (Ray) kills the node that runs the rank (its raylet), which must run
   no other group: the group restarts where the cluster has room and heals;
   ``lighthouse@S`` kills the Lighthouse the launcher runs once group 0 reports step S: the
   launcher restarts it and no group may notice. ``ft.max_replica_restarts`` is raised to the
   number of injections that strike a group.
3. The verdict (exit 0 only when every check holds):

   - no surviving replica group restarted (its ranks kept their pids, ``survivor_restarts`` 0)
     or stepped back (its steps only go up);
   - every failed replica group rejoined (healed from a live peer);
   - every replica group ends with bitwise-identical weights;
   - with ``lighthouse@S``: the Lighthouse was restarted as often as it was killed;
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

from ..launchers.base import LauncherHooks
from ..launchers.ft_record import read_events, read_steps
from ..launchers.registry import get_launcher
from ..rundir import files
from ..rundir.io import atomic_write_json, read_json, read_lines
from ..rundir.pids import live_rank_pid, live_recorded_pid
from ..rundir.record import RecordError, RunRecord
from .drill_launch import finish_launch, launch_cli, stop_launch

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
    r"(?P<kind>[a-z0-9]+)(?::replica(?P<replica>\d+)(?:\.rank(?P<rank>\d+))?)?"
    r"@(?P<step>\d+|heal)"
)
SIGNALS = {"kill9": signal.SIGKILL, "hang": signal.SIGSTOP}
"""What a signal kind does to the rank: a death, or a hang it cannot even report (the launcher's
hang watch must find it: ``ft.hang_timeout_s``)."""
ACTS = {
    "kill9": "kill -9",
    "hang": "SIGSTOP (a hang)",
    "nodekill": "kill of the node (raylet)",
    "lighthouse": "kill -9 of the Lighthouse",
}
LIGHTHOUSE = "lighthouse"
"""The one kind that strikes no replica group: ``lighthouse@STEP``."""


def ft_kinds(backend: str) -> tuple[str, ...]:
    """What the ft drill injects on ``backend``: a rank's signals and the Lighthouse everywhere,
    a node where the launcher kills nodes (its ``drill_kinds`` name ``nodekill``)."""
    node = ("nodekill",) if "nodekill" in get_launcher(backend).drill_kinds else ()
    return (*SIGNALS, *node, LIGHTHOUSE)


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
    target: str | None = None

    @property
    def strikes_group(self) -> bool:
        """Whether it fails its replica group (a Lighthouse kill fails none)."""
        return self.kind != LIGHTHOUSE


def wants_ft(overrides: list[str]) -> bool:
    """Whether the drilled run is an ``ft=torchft`` run."""
    return any(o.strip() in ("ft=torchft", "+ft=torchft") for o in overrides)


def _parse_one(
    item: str, replicas: int, earlier: list[FtInjection], kinds: tuple[str, ...]
) -> FtInjection:
    m = _SPEC.fullmatch(item)
    if m is None or (m["replica"] is None and m["kind"] != LIGHTHOUSE):
        raise FtDrillError(
            f"--inject {item!r}: expected KIND:replicaK@STEP, KIND:replicaK.rankR@STEP, "
            f"KIND:replicaK@heal or lighthouse@STEP under ft=torchft (KIND one of "
            f"{[k for k in kinds if k != LIGHTHOUSE]})"
        )
    if m["kind"] not in kinds:
        raise FtDrillError(
            f"--inject {item!r}: {m['kind']} is not drilled under ft=torchft on this "
            f"launcher; one of {list(kinds)}"
        )
    if m["kind"] == LIGHTHOUSE:
        return _lighthouse_at(item, m)
    return _group_strike(item, m, replicas, earlier)


def _lighthouse_at(item: str, m: re.Match[str]) -> FtInjection:
    if m["replica"] is not None or m["step"] == "heal":
        raise FtDrillError(
            f"--inject {item!r}: the Lighthouse is the run's, not a replica group's: "
            "lighthouse@STEP (when replica group 0 reaches STEP)"
        )
    return FtInjection(LIGHTHOUSE, 0, int(m["step"]))


def _group_strike(
    item: str, m: re.Match[str], replicas: int, earlier: list[FtInjection]
) -> FtInjection:
    """A strike at one replica group: at a step, or while it heals after an earlier strike."""
    replica = int(m["replica"])
    if not 0 <= replica < replicas:
        raise FtDrillError(
            f"--inject {item!r}: replica{replica} does not exist: ft.replicas={replicas} "
            f"(replica0..replica{replicas - 1})"
        )
    rank = int(m["rank"]) if m["rank"] is not None else None
    if m["step"] != "heal":
        return FtInjection(m["kind"], replica, int(m["step"]), rank)
    before = [i for i in earlier if i.replica == replica and i.strikes_group and not i.heal]
    if not before:
        raise FtDrillError(
            f"--inject {item!r}: @heal kills replica{replica} while it heals after a failure; "
            f"list a kill of replica{replica} at a step before it (kill9:replica{replica}@STEP)"
        )
    return FtInjection(m["kind"], replica, before[-1].step, rank, heal=True)


def parse_ft_injections(text: str, replicas: int, backend: str = "local") -> list[FtInjection]:
    """``kill9:replica1@8`` (``kill9:replica1.rank0@8``, ``kill9:replica1@heal``,
    ``nodekill:replica1@8``, ``lighthouse@8``) -> injections in step order (a heal's after the
    kill it follows)."""
    kinds = ft_kinds(backend)
    out: list[FtInjection] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        out.append(_parse_one(item, replicas, out, kinds))
    if not out:
        raise FtDrillError("--inject: no injection given")
    return sorted(out, key=lambda i: (i.step, i.heal))


def _wait(proc: subprocess.Popen[bytes], deadline: float) -> int:
    if (code := finish_launch(proc, deadline)) is None:
        raise FtDrillError("a run took longer than --timeout; it was stopped")
    return code


def _last_line(log: Path) -> str:
    """The log's last non-empty line (what a failed run said last), or a note that it has none."""
    last = ""
    try:
        for line in read_lines(log):
            last = line.strip() or last
    except OSError:
        pass
    return last or f"{log} is empty"


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


class _Striker:
    """What each kind does once its moment comes, through the run's launcher: a signal to a
    rank (``os.kill`` when it runs on this host, else through the launcher: Ray reaches any node),
    its node killed, or the Lighthouse killed."""

    def __init__(self, backend: str, run_dir: Path, replicas: int) -> None:
        self.launcher: LauncherHooks = get_launcher(backend)
        self.local = backend == "local"
        self.run_dir, self.replicas = run_dir, replicas

    def strike(self, inj: FtInjection) -> None:
        if inj.kind == LIGHTHOUSE:
            inj.pid, inj.at = self._lighthouse(), time.time()
            return
        pids = _pids(self.run_dir, inj.replica)
        inj.rank = max(pids) if inj.rank is None else inj.rank
        inj.pid = pids[inj.rank]
        where = files.ft_replica_dir(self.run_dir, inj.replica)
        if inj.kind == "nodekill":
            inj.target = self._node(where, inj)
        else:
            self._signal(where, inj.rank, inj.pid, SIGNALS[inj.kind])
        inj.at = time.time()

    def _signal(self, replica_dir: Path, rank: int, pid: int, signum: int) -> None:
        if self.local or live_rank_pid(replica_dir, rank) == pid:
            os.kill(pid, signum)
        elif not self.launcher.signal_rank(replica_dir, rank, signum):
            raise FtDrillError(f"rank {rank} of {replica_dir} could not be reached")

    def _node(self, replica_dir: Path, inj: FtInjection) -> str:
        """Kill the node of the rank, refused where another replica group runs on it too."""
        what = f"nodekill:replica{inj.replica}"
        node = self.launcher.node_of(replica_dir, inj.rank)
        if node is None:
            raise FtDrillError(f"{what}: rank {inj.rank} has no recorded node in {replica_dir}")
        shared = [
            k
            for k in range(self.replicas)
            if k != inj.replica
            and node
            in {
                self.launcher.node_of(files.ft_replica_dir(self.run_dir, k), r)
                for r in _pids(self.run_dir, k)
            }
        ]
        if shared:
            raise FtDrillError(
                f"{what}: its node {node[:12]} also runs replica group(s) {shared}, which "
                "would fail with it; give each group nodes of its own (launcher.cpus_per_rank "
                "up to a node's CPUs)"
            )
        try:
            return self.launcher.kill_node(replica_dir, inj.rank)
        except (ValueError, NotImplementedError) as exc:
            raise FtDrillError(f"{what}: {exc}") from None

    def _lighthouse(self) -> int:
        """SIGKILL the Lighthouse the launcher runs (on this host); its pid."""
        path = files.ft_lighthouse_pid(self.run_dir)
        pid = live_recorded_pid(path)
        if pid is None:
            raise FtDrillError(
                f"lighthouse: no live Lighthouse of this run on this host ({path}): the drill "
                "kills the Lighthouse the launcher runs (ft.lighthouse=null) where it runs"
            )
        os.kill(pid, signal.SIGKILL)
        return pid


def _inject(
    proc: subprocess.Popen[bytes],
    striker: _Striker,
    inj: FtInjection,
    deadline: float,
    log: Path,
    since: float = 0.0,
) -> None:
    """Wait until the replica group reaches the step (or heals after ``since``), then strike."""
    where = files.ft_replica_dir(striker.run_dir, inj.replica)
    moment = "a heal" if inj.heal else f"step {inj.step}"
    while not _reached(where, inj, since):
        if (code := proc.poll()) is not None:
            raise FtDrillError(
                f"the run ended (exit {code}) before replica{inj.replica} reached {moment}: "
                f"{_last_line(log)} (see {log})"
            )
        if time.monotonic() > deadline:
            raise FtDrillError(f"replica{inj.replica} never reached {moment}")
        time.sleep(0.02)
    striker.strike(inj)
    print(f"drill: {_said(inj)}", flush=True)


def _said(inj: FtInjection) -> str:
    when = "while it heals" if inj.heal else f"at step {inj.step}"
    if inj.kind == LIGHTHOUSE:
        return f"{ACTS[LIGHTHOUSE]} (pid {inj.pid}) at replica0's step {inj.step}"
    if inj.kind == "nodekill":
        return f"killed {inj.target} (rank {inj.rank} of replica{inj.replica}) {when}"
    return f"{ACTS[inj.kind]} rank {inj.rank} of replica{inj.replica} (pid {inj.pid}) {when}"


def _record(run_dir: Path) -> RunRecord | None:
    try:
        return RunRecord.read(run_dir)
    except RecordError:
        return None


def _final_loss(rec: RunRecord | None) -> float | None:
    value = ((rec.results if rec is not None else {}).get("0") or {}).get("final_loss")
    return float(value) if isinstance(value, (int, float)) else None


def _runs_ok(runs: list[RunRecord | None]) -> bool:
    return all(r is not None and r.status == "ok" for r in runs)


def _checks(
    reference: RunRecord | None,
    interrupted: RunRecord | None,
    ft: dict[str, Any],
    injections: list[FtInjection],
    survivors: dict[int, tuple[dict[int, int], dict[int, int]]],
    compared: bool,
) -> dict[str, bool]:
    recoveries = ft.get("recoveries") or []
    failed = {i.replica for i in injections if i.strikes_group}
    runs_ok = _runs_ok([interrupted, reference] if compared else [interrupted])
    lighthouse_kills = sum(i.kind == LIGHTHOUSE for i in injections)
    lighthouse = {"lighthouse_restarted": ft.get("lighthouse_restarts", 0) >= lighthouse_kills}
    return {
        **(lighthouse if lighthouse_kills else {}),
        "runs_ok": runs_ok,
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
    compared: bool = True,
) -> dict[str, Any]:
    """The checks and figures of the drill (see the module's docstring); ``compared`` False
    (``--no-reference``): no reference run, so no check of the loss against it."""
    ft = (interrupted.extra.get("ft") if interrupted is not None else None) or {}
    recoveries = ft.get("recoveries") or []
    checks = _checks(reference, interrupted, ft, injections, survivors, compared)
    ref_loss, int_loss = _final_loss(reference), _final_loss(interrupted)
    diff = abs(ref_loss - int_loss) if ref_loss is not None and int_loss is not None else None
    if compared:
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
    if "loss_within_atol" in summary["checks"]:
        lines.append(
            f"  final loss: reference {loss['reference']}, interrupted {loss['interrupted']}, "
            f"|diff| {loss['abs_diff']} (atol {summary['atol']})"
        )
    else:
        lines.append(f"  final loss: {loss['interrupted']} (no reference run: --no-reference)")
    lines.append(f"  seconds to rejoin: {summary['seconds_to_rejoin']}")
    lines.append(f"  steps lost by the survivors: {summary['survivor_steps_lost']}")
    lines.append(
        f"  steps the failed replica group missed: {summary['failed_replica_steps_missed']}"
    )
    if not summary["ok"]:  # which group restarted, why, and how it came back
        lines += [f"  recovery: {_recovery_line(r)}" for r in summary["recoveries"]]
    return "\n".join(lines)


def _recovery_line(rec: dict[str, Any]) -> str:
    healed = rec.get("healed_from")
    return (
        f"replica {rec.get('replica')} rank {rec.get('rank')} ({rec.get('cause')}) failed at step "
        f"{rec.get('failed_at_step')}, back at step {rec.get('rejoined_at_step')}"
        + (f" healed from replica {healed}" if healed is not None else " (no heal)")
    )


def _replicas(overrides: list[str]) -> int:
    for o in overrides:
        if o.startswith("ft.replicas="):
            return int(o.split("=", 1)[1])
    return 2


def _planned(i: FtInjection) -> str:
    if i.kind == LIGHTHOUSE:
        return f"  {ACTS[LIGHTHOUSE]} at replica0's step {i.step}"
    rank = "the last rank" if i.rank is None else f"rank {i.rank}"
    when = "while it heals after that" if i.heal else f"at its step {i.step}"
    return f"  {ACTS[i.kind]} of {rank} of replica{i.replica} {when}"


def _restarts(injections: list[FtInjection]) -> str:
    return f"ft.max_replica_restarts={sum(i.strikes_group for i in injections)}"


def describe_ft_drill(
    overrides: list[str], inject: str, backend: str = "local", reference: bool = True
) -> str:
    """The plan of the drill (``--dry-run``): the runs and the kills; raises on bad input."""
    injections = parse_ft_injections(inject, _replicas(overrides), backend)
    lines = [
        "ft drill: a reference run, then the same run with:"
        if reference
        else "ft drill (no reference run): the run with:",
        *(_planned(i) for i in injections),
        f"  overrides: {' '.join(overrides)} {_restarts(injections)}",
    ]
    return "\n".join(lines)


def _strike_all(
    proc: subprocess.Popen[bytes],
    striker: _Striker,
    injections: list[FtInjection],
    log: Path,
    deadline: float,
) -> dict[int, dict[int, int]]:
    """Every injection in turn; the groups never struck, each with its ranks' pids at the first
    strike (to compare with theirs at the end)."""
    struck = {i.replica for i in injections if i.strikes_group}
    survivors: dict[int, dict[int, int]] = {}
    for inj in injections:
        since = max(
            (i.at or 0.0 for i in injections if i.replica == inj.replica and i.strikes_group),
            default=0,
        )
        _inject(proc, striker, inj, deadline, log, since)
        for k in range(striker.replicas):
            if k not in struck and k not in survivors:
                survivors[k] = _pids(striker.run_dir, k)
    return survivors


def run_ft_drill(
    overrides: list[str],
    inject: str,
    directory: Path,
    timeout: float,
    atol: float | None,
    backend: str = "local",
    reference: bool = True,
) -> int:
    """Both runs (only the interrupted one without ``reference``) and the verdict; the exit
    code (0: every check holds, 1: one does not)."""
    replicas = _replicas(overrides)
    injections = parse_ft_injections(inject, replicas, backend)
    overrides = [f"launcher={backend}", *overrides]
    directory.mkdir(parents=True, exist_ok=True)
    ref_dir, int_dir = directory / "reference", directory / "interrupted"
    ref_log, int_log = directory / "reference.log", directory / "interrupted.log"
    if reference:
        print(f"drill: reference run in {ref_dir}", flush=True)
        if code := _wait(launch_cli(overrides, ref_dir, ref_log), time.monotonic() + timeout):
            raise FtDrillError(
                f"the reference run failed (exit {code}): {_last_line(ref_log)} (see {ref_log})"
            )
    deadline = time.monotonic() + timeout
    print(f"drill: interrupted run in {int_dir}", flush=True)
    proc = launch_cli([*overrides, _restarts(injections)], int_dir, int_log)
    striker = _Striker(backend, int_dir, replicas)
    try:
        before = _strike_all(proc, striker, injections, int_log, deadline)
        _wait(proc, deadline)
    finally:
        stop_launch(proc)
    survivors = {k: (pids, _pids(int_dir, k)) for k, pids in before.items()}
    summary = verdict(
        _record(ref_dir) if reference else None,
        _record(int_dir),
        injections,
        survivors,
        DEFAULT_ATOL if atol is None else atol,
        compared=reference,
    )
    atomic_write_json(directory / "drill.json", summary)
    print(render(summary), flush=True)
    return 0 if summary["ok"] else 1
