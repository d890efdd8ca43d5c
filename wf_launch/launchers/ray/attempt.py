"""One attempt of a Ray run: place it, start one actor per rank, watch them, take it all down.

A placement group (waited for up to ``launcher.placement_timeout_s``; longer while another sweep
point runs), one :class:`~.rank_entry.WfRayRank` per rank (a node that does not see the run dir
ends the run, exit 2), every rank's ``run`` watched, then every actor killed, the group removed."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...observe.stacks import rank_ranges
from ...observe.watch import PEERS_GRACE_S, RankWatch, StartupTimeout
from ...rank.entrypoint import RankSpec
from ...rank.ft import RESTART_COUNT_ENV, ft_enabled
from ...rundir import attempts, files
from ...rundir.record import Status
from ..interrupt import Stopped
from . import ray_adapter as rt
from . import state
from .cluster import alive_nodes, describe_nodes
from .failure import FailureContext, Outcome, Verdict, explain, node_text
from .placement import Slot, assign, cuda_orders, local_ranks, rank_env, shape
from .rank_entry import RayPreempt, RayStackDump, RunDirNotShared, WfRayRank, signal_ranks

POLL_S = 0.2
_RANK_ACTOR: dict[str, Any] = {}


@dataclass
class Ended:
    """How an attempt ended: ok, failed, invalid, preempted, interrupted or cancelled."""

    kind: str
    verdict: Verdict | None = None
    signal: str | None = None
    ended_by: str = ""


@dataclass
class Attempt:
    """One attempt: its placement group, actors, where each rank is, how each rank's run ended."""

    run: Any  # the RayRun this attempt belongs to (plan, options, cancel flag, live view)
    number: int
    restart: int
    pg: Any = None
    slots: list[Slot] = field(default_factory=list)
    actors: dict[int, Any] = field(default_factory=dict)
    where: dict[int, dict[str, Any]] = field(default_factory=dict)
    refs: dict[Any, int] = field(default_factory=dict)
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    asked: dict[Any, int] = field(default_factory=dict)
    startup: Any = None

    @property
    def run_dir(self) -> Path:
        return Path(self.run.plan.run_dir)

    @property
    def world(self) -> int:
        return int(self.run.plan.world_size)

    def place(self) -> Ended | None:
        """Create the placement group and wait for it; an :class:`Ended` when it was not placed."""
        lc = self.run.lc
        plan_shape = shape(self.world, lc.nodes, lc.cpus_per_rank, lc.gpus_per_rank)
        state.update(self.run_dir, state="placing", attempt=self.number, placement={})
        self.pg = rt.placement_group(
            plan_shape.bundles, plan_shape.strategy, name=f"wf_launch {self.run_dir}"
        )
        deadline = time.monotonic() + float(lc.placement_timeout_s)
        while not rt.pg_ready(self.pg, POLL_S * 2):
            self.run.check_cancel()
            if time.monotonic() > deadline and not self.run.queue_busy():
                message = (
                    f"the placement group ({plan_shape.describe()}) was not placed within "
                    f"{float(lc.placement_timeout_s):g} s (launcher.placement_timeout_s): the "
                    f"cluster is busy; its nodes: {describe_nodes(alive_nodes())}"
                )
                cause = {"rank": -1, "cause": "placement_timeout", "type": "PlacementTimeout"}
                return Ended(
                    "failed", Verdict({**cause, "message": message}, message, "placement timed out")
                )
        self.slots = assign(self.world, plan_shape, rt.bundle_nodes(self.pg))
        return None

    def start_actors(self) -> Ended | None:
        """One actor per rank in its bundle, each asked where it is. The ranks start once rank 0
        answered (its address is the rendezvous; with GPUs once every rank has: their order on a
        node needs them all), while later actors still come up."""
        lc = self.run.lc
        if "cls" not in _RANK_ACTOR:
            _RANK_ACTOR["cls"] = rt.remote(WfRayRank)
        options: dict[str, Any] = {
            "num_cpus": float(lc.cpus_per_rank),
            "num_gpus": float(lc.gpus_per_rank),
            "max_restarts": 0,
            "max_task_retries": 0,
        }
        if lc.runtime_env:
            options["runtime_env"] = dict(lc.runtime_env)
        for slot in self.slots:
            where = rt.in_bundle(self.pg, slot.bundle)
            self.actors[slot.rank] = (
                _RANK_ACTOR["cls"].options(scheduling_strategy=where, **options).remote()
            )
        state.update(self.run_dir, state="starting")
        self.asked = {a.where.remote(str(self.run_dir), r == 0): r for r, a in self.actors.items()}
        needed = [ref for ref, r in self.asked.items() if r == 0 or lc.gpus_per_rank]
        timeout = float(self.run.plan.config["engine"]["init_timeout_s"])
        ready, pending = rt.wait_all(needed, timeout)
        self._answers(ready)
        if self.outcomes:
            return self.failed([])
        if pending:
            late = sorted(self.asked[p] for p in pending)
            message = (
                f"rank actor(s) {rank_ranges(late)} did not start within {timeout:g} s "
                "(engine.init_timeout_s): "
                "the cluster could not start their processes (see Ray's logs on their nodes)"
            )
            cause = {"rank": late[0], "cause": "init_timeout", "type": "ActorStartTimeout"}
            cause.update(message=message, missing_ranks=late, coords=self._coords(late[0]))
            return Ended("failed", Verdict(cause, message, "rank actors did not start"))
        return self._check_run_dir()

    def _coords(self, rank: int) -> Any:
        return self.run.plan.layout.coords(rank)

    def _answers(self, refs: list[Any]) -> None:
        """Take the actors' answers to ``where`` (a failed one is that rank's outcome)."""
        for ref in refs:
            rank = self.asked.pop(ref)
            try:
                self.where[rank] = {**rt.get(ref), "node": self.slots[rank].node}
            except Exception as exc:
                self.outcomes[rank] = _outcome_of_error(exc)
        if refs and not self.asked and self.refs:
            state.update(self.run_dir, placement=state.record_placement(self.where))

    def _check_run_dir(self) -> Ended | None:
        blind = {r for r, w in self.where.items() if not w.get("sees_run_dir")}
        blind = sorted(blind | {r for r, o in self.outcomes.items() if o.kind == "unshared"})
        if not blind:
            return None
        w = self.where.get(blind[0]) or {"node": self.slots[blind[0]].node}
        message = (
            f"hydra.run.dir={str(self.run_dir)!r} is not allowed: rank(s) {rank_ranges(blind)} on "
            f"{node_text(w)} do not see it (no {files.CONFIG} there); launcher=ray needs the run "
            "directory on storage every node sees (a shared file system; a single host is fine)"
        )
        cause = {"rank": blind[0], "cause": "invalid_config", "type": "RunDirNotShared"}
        cause.update(message=message, node=w.get("node"), host=w.get("host"))
        summary = f"wf_launch: config error: {message}"
        return Ended("invalid", Verdict(cause, summary, "run directory not shared", Status.INVALID))

    def start_ranks(self, write: Callable[[str], None]) -> None:
        """Every rank's environment, then its ``run`` (``rank_main``); the start-up watch first."""
        lc, plan, opts = self.run.lc, self.run.plan, self.run.opts
        threads = max(1, int(float(lc.cpus_per_rank)))
        self.startup = RankWatch(  # forgets earlier attempts' start-up markers
            self.run_dir,
            self.world,
            plan.label,
            float(plan.config["engine"]["init_timeout_s"]),
            write=write,
            send=lambda pids, signum: self.reach(set(pids), signum),
        )
        spec = RankSpec(
            config=plan.config,
            run_dir=str(self.run_dir),
            threads_per_rank=threads,
            console_ranks=lc.console_ranks,
            launch_time=self.run.launch_time,
            max_log_mb=float(lc.max_log_mb or 0),
            on_timeout=RayStackDump(str(self.run_dir)),
            attempt_base=self.number,
            preempt=RayPreempt("TERM", 20.0, self.restart, int(lc.max_restarts)),
        )
        master = (str(self.where[0]["ip"]), int(self.where[0]["port"]))
        local = local_ranks(self.slots)
        cuda = cuda_orders(self.slots, {r: w.get("gpus") or [] for r, w in self.where.items()})
        # TORCHELASTIC_RESTART_COUNT as torch's agent sets it: the restarts of this launch
        forward = {
            "OMP_NUM_THREADS": str(threads),
            RESTART_COUNT_ENV: str(self.restart),
            **opts.forward,
        }
        for s in self.slots:
            env = rank_env(s, self.world, local[s.rank], master, self.number, cuda.get(s.rank))
            ref = self.actors[s.rank].run.remote(spec, {**forward, **env}, list(opts.path))
            self.refs[ref] = s.rank
        state.update(self.run_dir, state="running", placement=state.record_placement(self.where))

    def watch(self) -> Ended:
        """Poll the ranks until all ended or one failed; take the later actors' answers."""
        while self.refs:
            self._collect(rt.wait(list(self.refs), POLL_S)[0])
            if self.asked:
                self._answers(rt.wait_all(list(self.asked), 0)[0])
                blind = self._check_run_dir()
                if blind is not None:
                    return blind
            self.run.tick()
            try:
                self.startup.tick(self.pids(self.refs.values()))
            except StartupTimeout as exc:
                cause, summary = exc.failure(self.run_dir, self.run.plan.label, self._coords)
                cause["node"] = (self.where.get(cause["rank"]) or {}).get("node")
                verdict = Verdict(cause, summary, "start-up timeout")
                return Ended("failed", verdict, ended_by="start-up timeout")
            self.run.check_cancel()
            if any(o.kind not in ("ok", "preempted") for o in self.outcomes.values()):
                return self._check_run_dir() or self.failed(sorted(self.refs.values()))
            if any(o.kind == "preempted" for o in self.outcomes.values()):
                self._collect(rt.wait_all(list(self.refs), self.run.lc.shutdown_timeout_s)[0])
                return Ended("preempted", ended_by=self._ended_by("preempted: SIGTERM"))
        ended_by = self._ended_by("completed")
        if ended_by.startswith("stop flag"):
            name = ended_by.partition(":")[2].strip()
            return Ended(
                "interrupted", None, name if name.startswith("SIG") else "SIGTERM", ended_by
            )
        return Ended("ok", ended_by="completed")

    def _ended_by(self, default: str) -> str:
        """How rank 0 recorded the attempt's end."""
        return str((attempts.read(self.run_dir, self.number) or {}).get("ended_by") or default)

    def _collect(self, ready: list[Any]) -> None:
        for ref in ready:
            self.outcomes[self.refs.pop(ref)] = _outcome(ref)

    def pids(self, ranks: Any) -> dict[int, int]:
        """rank -> pid of ``ranks`` (as their actors reported)."""
        return {r: int(self.where[r]["pid"]) for r in ranks if r in self.where}

    def reach(self, ranks: Any, signum: int, timeout_s: float = 10.0) -> set[int]:
        """Signal ``ranks`` wherever they run (nodes whose raylet does not answer are skipped)."""
        where = {
            r: (str(self.where[r]["node"]), int(self.where[r]["pid"]))
            for r in ranks
            if r in self.where and self.run.node_alive(str(self.where[r]["node"]))
        }
        return signal_ranks(self.run_dir, where, signum, timeout_s) if where else set()

    def failed(self, pending: list[int]) -> Ended:
        """The first failure: the stacks of the ranks still running, late outcomes, the cause."""
        dumps = None
        if ft_enabled(self.run.plan.config):
            pending = []  # a replica group's ranks have nothing to save: torn down at once
        if pending:  # peers of a timed-out collective end moments later, with their own records
            self._collect(rt.wait_all(list(self.refs), PEERS_GRACE_S)[0])
            pending = sorted(self.refs.values())
        if pending:
            # Through Ray, to ranks on any node: on a loaded cluster signal and dump take seconds.
            dumps = self.startup.autopsy(self.pids(pending), wait_s=6.0)
            self._collect(rt.wait_all(list(self.refs), 0.5)[0])
        plan = self.run.plan
        ctx = FailureContext(
            self.run_dir,
            self.world,
            plan.label,
            plan.layout.coords,
            self.where,
            self.run.node_alive,
            self.number,
        )
        verdict = explain(ctx, self.outcomes, sorted(self.refs.values()), dumps)
        kind = "invalid" if verdict.status is Status.INVALID else "failed"
        return Ended(kind, verdict, ended_by=verdict.ended_by)

    def stop(self, kind: str, name: str) -> Ended:
        """Interrupted or cancelled: SIGTERM every rank (the task saves at its next step), wait."""
        state.update(self.run_dir, state="stopping")
        if self.refs:
            self.reach(sorted(self.refs.values()), int(signal.SIGTERM))
            try:
                self._collect(rt.wait_all(list(self.refs), self.run.lc.shutdown_timeout_s)[0])
            except (KeyboardInterrupt, Stopped):
                pass  # asked again: stop waiting
        return Ended(kind, signal=name, ended_by=name)

    def teardown(self) -> None:
        """Kill every actor of the attempt and remove its placement group."""
        for actor in self.actors.values():
            rt.kill(actor)
        if self.pg is not None:
            rt.remove_placement_group(self.pg)
        self.refs.clear()


def _outcome_of_error(exc: Exception) -> Outcome:
    kind = rt.classify_error(exc)
    if kind == "raised" and RunDirNotShared.__name__ in str(exc):
        kind = "unshared"
    return Outcome(kind, str(exc))


def _outcome(ref: Any) -> Outcome:
    try:
        value = rt.get(ref)
    except Exception as exc:
        return _outcome_of_error(exc)
    return Outcome("preempted" if isinstance(value, dict) and value.get("preempted") else "ok")
