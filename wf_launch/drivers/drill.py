"""The preemption drill: run a task twice, once interrupted, and check the results are identical.

``python -m wf_launch.drill [OVERRIDES...] [--inject SPEC | --random N] [--backend NAME]``

1. The *reference* run: the task with ``OVERRIDES``, uninterrupted, in ``DIR/reference``.
2. The *interrupted* run: the same, in ``DIR/interrupted``, with interruptions injected
   when the ranks' published progress (``ctx.progress``) reaches the chosen steps:

   - ``kill9[:RANK]@STEP`` (local): ``kill -9`` one rank (the last one by default); the
     launcher restarts the ranks (``launcher.max_restarts`` is set to the number of
     kills) and they resume from the newest complete checkpoint;
   - ``sigterm@STEP`` (local): SIGTERM to the launcher: the ranks' stop flag is set,
     the task saves and returns, the launcher exits 143; the drill then relaunches the
     same run directory with ``launcher.resume=true``;
   - ``usr2@STEP`` (slurm): ``scancel --signal=USR2`` to the job (the preemption
     warning): the task saves at the agreed step and the job requeues itself;
   - ``kill9[:RANK]@STEP`` (ray): ``kill -9`` one rank on whichever node it runs;
     ``nodekill[:RANK]@STEP`` (ray): kill the raylet of a node that runs ranks (of RANK, or
     of the last rank not on the head node): every rank on it ends, the run restarts on
     the nodes still alive (``launcher.max_restarts`` is set to the number of both).

3. The verdict: identical or not (rank 0's ``weights_sha256`` and ``final_loss``),
   attempts made, steps lost per attempt (``result.json``'s ``attempts``) and time lost
   per interruption (from the interruption until rank 0 is back at the step it had
   reached). ``DIR/drill.json`` keeps all of it. Exit code 0 only when identical.

Across a layout change (:mod:`wf_launch.drivers.drill_layout`): ``--resume-with OVERRIDES``
relaunches the interrupted run at another layout after a ``sigterm`` (locally) or a
``usr2`` (SLURM: the drill cancels the requeued job once the stop was saved and submits
again), and ``--atol`` (default 1e-4 with ``--resume-with``) compares the loss curve, the
final loss and the final weights within a tolerance instead of bitwise.

The task must checkpoint with ``ctx.checkpoint``, poll ``ctx.should_stop()``, report
``ctx.progress(step, total, ...)`` and return ``weights_sha256`` and ``final_loss``
from rank 0 (the built-in ``task=train`` does); a script (``task=script``) does the same
with ``wf_launch.checkpoint``, ``should_stop``, ``progress`` and ``report_result``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError

from worldfoundry.core.validation import is_int

from ..cli import register_configs
from ..config.layout import layout_of
from ..config.overrides import hydra_config_error, refuse_schemas, task_modules
from ..config.redact import redact_overrides
from ..launchers.registry import get_launcher, registered_launchers
from ..rank.task_registry import load_task_modules
from ..readers.plot import metric_lines
from ..rundir import attempts, files
from ..rundir.claim import RunDirClaim, RunDirInUse, claim_tool_dir, private_umask
from ..rundir.io import atomic_write_json
from ..rundir.progress import read_progress
from ..rundir.record import RecordError, RunRecord, Status
from . import drill_layout
from .drill_ft import FtDrillError, describe_ft_drill, run_ft_drill, wants_ft
from .drill_launch import finish_launch, launch_cli, stop_launch, terminated_as_exit

__all__ = ["Injection", "main", "parse_injections"]

RANKED = ("kill9", "nodekill")
"""Kinds that take a rank (``kill9:RANK@STEP``; ``nodekill:RANK@STEP``: the node that runs RANK)."""
COMPARED = ("weights_sha256", "final_loss")
OWNED = (
    "hydra.run.dir",
    "hydra.sweep.dir",
    "launcher.resume",
    "launcher.overwrite",
    "launcher.wait",
    "launcher",
)
_SPEC = re.compile(r"(?P<kind>[a-z0-9]+)(?::(?P<rank>\d+))?@(?P<step>\d+)")


class DrillError(Exception):
    """The drill could not do what it was asked (bad arguments, a run that never got there)."""


def backends() -> list[str]:
    """The launchers the drill can interrupt: those whose hooks name interruptions."""
    return [name for name, cls in registered_launchers().items() if cls.drill_kinds]


def kinds_of(backend: str) -> tuple[str, ...]:
    """The interruptions of ``backend`` (its launcher's ``drill_kinds`` hook)."""
    return tuple(get_launcher(backend).drill_kinds)


@dataclass
class Injection:
    """One interruption: ``kind`` at ``step`` (``rank``: the rank a kill9 hits; None: the last)."""

    kind: str
    step: int
    rank: int | None = None
    at: float | None = None
    reached_step: int | None = None
    target: str | None = None
    time_lost_s: float | None = None


def parse_injections(text: str, backend: str) -> list[Injection]:
    """``kill9@12,sigterm@20`` -> injections in step order; :class:`DrillError` names a bad item."""
    out = []
    for item in [t.strip() for t in text.split(",") if t.strip()]:
        m = _SPEC.fullmatch(item)
        if m is None:
            raise DrillError(
                f"--inject {item!r}: expected KIND@STEP or kill9:RANK@STEP, "
                "e.g. kill9@12,sigterm@20"
            )
        kind, step = m["kind"], int(m["step"])
        if kind not in kinds_of(backend):
            raise DrillError(
                f"--inject {item!r}: {kind!r} is not an interruption of the {backend} backend; "
                f"choose from {list(kinds_of(backend))}"
            )
        if m["rank"] is not None and kind not in RANKED:
            raise DrillError(f"--inject {item!r}: only {' and '.join(RANKED)} take a rank")
        if step < 1:
            raise DrillError(f"--inject {item!r}: the step must be >= 1")
        out.append(Injection(kind, step, None if m["rank"] is None else int(m["rank"])))
    if not out:
        raise DrillError("--inject: no interruption given")
    steps = [i.step for i in out]
    if steps != sorted(set(steps)):
        raise DrillError(f"--inject: steps must be distinct and increasing, got {steps}")
    return out


def random_injections(n: int, total: int, backend: str, seed: int) -> list[Injection]:
    """``n`` interruptions of the backend's kinds at distinct random steps in ``[2, total - 2]`` (a
    stop is agreed a step after it is asked, and a kill must come after a checkpoint)."""
    if not 1 <= n <= total - 3:
        raise DrillError(
            f"--random {n}: expected 1 .. {max(total - 3, 0)} (the task runs {total} steps; "
            "interruptions land between step 2 and step total - 2)"
        )
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(2, total - 1), n))
    return [Injection(rng.choice(kinds_of(backend)), s) for s in steps]


STOP_KINDS = ("sigterm", "usr2")
"""Interruptions that go through the stop flag: agreed a step after they are asked, then the task
saves."""


def composed_task(overrides: list[str]) -> dict[str, Any]:
    """The run's ``task`` section as ``python -m wf_launch OVERRIDES`` would compose it (Hydra's
    compose API), so the drill can check its injections before anything runs; :class:`DrillError`
    for a config mistake."""
    plain = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]
    try:
        load_task_modules(task_modules(overrides))
        register_configs()
        refuse_schemas(plain)
        for name in ("wf_uid", "wf_config_groups"):
            OmegaConf.register_new_resolver(name, str, replace=True)
        with initialize_config_module(config_module="wf_launch.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=plain)
        task = {key: _resolved(cfg.task, key) for key in cfg.task}
    except Exception as exc:
        error = hydra_config_error(exc, plain)
        if error is None and not isinstance(exc, ImportError):
            raise
        raise DrillError(f"config error: {error or exc}") from None
    return task if isinstance(task, dict) else {}


def _resolved(section: Any, key: str) -> Any:
    """``section[key]`` resolved; None for a value that needs a running Hydra app
    (``${hydra:runtime.cwd}``)."""
    try:
        value = section[key]
    except InterpolationResolutionError:
        return None
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def check_injections(
    injections: list[Injection], task: dict[str, Any], given: set[str]
) -> tuple[list[str], list[str]]:
    """Refuse an injection that proves nothing; returns (overrides the drill adds, what it says
    about them).

    An injection at or past the task's last step lands when there is nothing left to interrupt, and
    a stop (``sigterm``, ``usr2``) is agreed one step after it is asked, so it must come two steps
    before the end. A ``kill9`` with no checkpoint before it only proves that a fresh start is
    deterministic: unless a stop saved one earlier, the drill sets ``task.checkpoint_every`` itself
    when the command left it at 0 (saying so) and refuses an explicit value that saves nothing
    before the kill.
    """
    steps, every = task.get("steps"), task.get("checkpoint_every")
    if isinstance(steps, int):
        _check_room_after(injections, steps)
    if not isinstance(every, int):
        return [], []
    return _checkpoint_before_kills(injections, every, "task.checkpoint_every" in given)


def _check_room_after(injections: list[Injection], steps: int) -> None:
    """:class:`DrillError` for an injection that leaves no step to resume before the task ends."""
    for inj in injections:
        last = steps - (2 if inj.kind in STOP_KINDS else 1)
        if inj.step > last:
            why = "its stop is agreed a step later, " if inj.kind in STOP_KINDS else ""
            raise DrillError(
                f"--inject {inj.kind}@{inj.step}: the task runs task.steps={steps} steps and "
                f"{why}an interruption there leaves nothing to resume: choose a step <= "
                f"{max(last, 0)}, or raise task.steps"
            )


def _checkpoint_before_kills(
    injections: list[Injection], every: int, explicit: bool
) -> tuple[list[str], list[str]]:
    """A ``task.checkpoint_every`` that saves before the first kill no stop covers (the override
    and a note), nothing when every kill is covered; :class:`DrillError` when ``explicit``
    forbids it."""
    uncovered = [
        i
        for i in injections
        if i.kind in RANKED
        and not any(s.kind in STOP_KINDS and s.step < i.step for s in injections)
        and not (0 < every < i.step)
    ]
    if not uncovered:
        return [], []
    kind, first = min((i.step, i.kind) for i in uncovered)[::-1]
    if explicit:
        raise DrillError(
            f"--inject {kind}@{first}: no checkpoint precedes it "
            f"(task.checkpoint_every={every}), so the restart starts from scratch and proves "
            "nothing about resuming; choose "
            f"task.checkpoint_every between 1 and {first - 1}, or a later step"
        )
    if first < 2:
        raise DrillError(
            f"--inject {kind}@{first}: no checkpoint can precede step {first}; choose a step >= 2"
        )
    chosen = max(1, (first - 1) // 2)
    return [f"task.checkpoint_every={chosen}"], [
        f"{kind}@{first} needs a checkpoint before it and task.checkpoint_every was {every} "
        f"(0: save only on a stop), so the drill sets task.checkpoint_every={chosen} "
        "(for both runs)"
    ]


# ------------------------------------------------------------------ running the CLI
def _finish(proc: subprocess.Popen[bytes], deadline: float) -> int:
    if (code := finish_launch(proc, deadline)) is None:
        raise DrillError("the run did not finish within --timeout")
    return code


def _world_size(run_dir: Path) -> int:
    return layout_of(files.read_config(run_dir, strict=True)).world_size


@dataclass
class _Run:
    """One of the drill's two runs, as it went."""

    run_dir: Path
    overrides: list[str]
    launches: int = 0
    wall_s: float = 0.0
    exit_codes: list[int] = field(default_factory=list)


class Drill:
    """The two runs, the injections, the verdict."""

    def __init__(
        self,
        overrides: list[str],
        backend: str,
        directory: Path,
        timeout_s: float,
        poll_s: float = 0.05,
        resume_with: list[str] | None = None,
        atol: float | None = None,
    ) -> None:
        self.overrides = overrides
        self.backend = backend
        self.dir = directory
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.resume_with = (
            resume_with or []
        )  # overrides of every relaunch: the run continues at another layout
        self.atol = atol  # compare within this tolerance instead of bitwise
        self._proc: subprocess.Popen[bytes] | None = None

    def _relaunch(self, run: _Run) -> list[str]:
        """The overrides of a relaunch into the same run directory (at the ``--resume-with`` layout,
        if given)."""
        if self.resume_with:
            return drill_layout.relaunch_overrides(run.overrides, self.resume_with)
        return [*run.overrides, "launcher.resume=true"]

    def _relaunch_after_saved_stop(
        self, run: _Run, log: Path, attempt: int, deadline: float
    ) -> None:
        """SLURM with ``--resume-with``: once the stop was saved (the job, launched with
        ``max_requeues=0``, does not requeue), end the launch and relaunch at the new layout."""
        proc = self._proc
        if not drill_layout.wait_for_saved_stop(run.run_dir, attempt, proc, deadline):
            raise DrillError(
                f"usr2: the run never recorded its stop (attempt {attempt}); see {log}"
            )
        stop_launch(proc)
        run.exit_codes.append(proc.returncode if proc is not None else -1)
        self._proc = launch_cli(self._relaunch(run), run.run_dir, log)
        run.launches += 1

    def _launch_overrides(self, injections: list[Injection]) -> list[str]:
        given = {o.split("=", 1)[0].lstrip("+~") for o in self.overrides}
        extra = [f"launcher={self.backend}"]
        if self.backend == "slurm":
            extra.append("launcher.wait=true")
            if self.resume_with and "launcher.max_requeues" not in given:
                # the drill relaunches at the new layout itself; a requeue would race it (and
                # could finish the run first)
                extra.append("launcher.max_requeues=0")
        kills = sum(i.kind in RANKED for i in injections)
        if kills and "launcher.max_restarts" not in given:
            extra.append(f"launcher.max_restarts={kills}")
        if self.backend == "local" and "launcher.shutdown_timeout_s" not in given:
            extra.append(
                "launcher.shutdown_timeout_s=60"
            )  # SIGTERM: time for the task to save and return
        return extra + self.overrides

    def reference(self) -> _Run:
        run = _Run(self.dir / "reference", self._launch_overrides([]))
        t0 = time.monotonic()
        proc = launch_cli(run.overrides, run.run_dir, self.dir / "reference.log")
        try:
            run.exit_codes.append(_finish(proc, t0 + self.timeout_s))
        except BaseException:
            stop_launch(proc)
            raise
        run.launches, run.wall_s = 1, time.monotonic() - t0
        return run

    def interrupted(self, injections: list[Injection]) -> _Run:
        run = _Run(self.dir / "interrupted", self._launch_overrides(injections))
        log = self.dir / "interrupted.log"
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        self._proc = launch_cli(run.overrides, run.run_dir, log)
        run.launches = 1
        try:
            self._inject(run, injections, log, deadline)
            run.exit_codes.append(_finish(self._proc, deadline))
        except BaseException:
            stop_launch(
                self._proc
            )  # never leave a run behind (on SLURM its launcher cancels the job on SIGTERM)
            raise
        run.wall_s = time.monotonic() - t0
        _time_lost(run.run_dir, injections)
        return run

    def _inject(self, run: _Run, injections: list[Injection], log: Path, deadline: float) -> None:
        """Each interruption in turn, at its step (``self._proc``: the launch process now)."""
        seen_pids: set[int] = set()
        since = 0.0
        for inj in injections:
            state = self._wait_for_step(
                self._proc, run.run_dir, inj.step, since, seen_pids, deadline
            )
            if state is None:
                raise DrillError(
                    f"the run ended before step {inj.step} ({inj.kind} never injected); see {log}"
                )
            inj.reached_step = max(s["step"] for s in state.values())
            seen_pids |= {int(s["pid"]) for s in state.values() if s.get("pid")}
            inj.at = time.time()
            _Interrupt(self, run, log, deadline).apply(inj, state)
            since = inj.at

    def _wait_for_step(
        self,
        proc: subprocess.Popen[bytes],
        run_dir: Path,
        step: int,
        since: float,
        old_pids: set[int],
        deadline: float,
    ) -> dict[int, dict[str, Any]] | None:
        """Every rank's progress once one has reached ``step`` in this attempt (None: the run ended
        first)."""
        world = None
        while time.monotonic() < deadline:
            if world is None and files.config_path(run_dir).exists():
                world = _world_size(run_dir)
            if world is not None:
                state = {
                    r: s
                    for r, s in read_progress(run_dir, world).items()
                    if float(s.get("time") or 0) > since and int(s.get("pid") or 0) not in old_pids
                }
                if state and max(s["step"] for s in state.values()) >= step:
                    return state
            if proc.poll() is not None:
                return None
            time.sleep(self.poll_s)
        raise DrillError(f"step {step} not reached within --timeout")


class _Interrupt:
    """One interruption of the interrupted run, by kind: what is signalled is the launcher's
    business (its hooks: ``kill_rank``, ``signal_ranks``, ``kill_node``); what the drill does
    next (relaunch after a stop) is the drill's."""

    def __init__(self, drill: Drill, run: _Run, log: Path, deadline: float) -> None:
        self.drill, self.run, self.log, self.deadline = drill, run, log, deadline
        self.launcher = get_launcher(drill.backend)

    def apply(self, inj: Injection, state: dict[int, dict[str, Any]]) -> None:
        {
            "kill9": self.kill9,
            "sigterm": self.sigterm,
            "usr2": self.usr2,
            "nodekill": self.nodekill,
        }[inj.kind](inj, state)

    def kill9(self, inj: Injection, state: dict[int, dict[str, Any]]) -> None:
        """SIGKILL one rank (the last one by default), wherever its launcher runs it."""
        rank = max(state) if inj.rank is None else inj.rank
        try:
            inj.target = self.launcher.kill_rank(self.run.run_dir, rank, state)
        except ValueError as exc:
            raise DrillError(str(exc)) from None
        inj.rank = rank

    def sigterm(self, inj: Injection, state: dict[int, dict[str, Any]]) -> None:
        """SIGTERM to the launch: the ranks save and stop; then relaunch the same run directory."""
        proc, run = self.drill._proc, self.run
        os.kill(proc.pid, signal.SIGTERM)
        inj.target = f"launcher pid {proc.pid}"
        run.exit_codes.append(_finish(proc, self.deadline))
        self.drill._proc = launch_cli(self.drill._relaunch(run), run.run_dir, self.log)
        run.launches += 1

    def usr2(self, inj: Injection, state: dict[int, dict[str, Any]]) -> None:
        """The scheduler's preemption warning to every rank; the job requeues itself."""
        run_dir = self.run.run_dir
        attempt = attempts.count(run_dir) - 1
        if not self.launcher.signal_ranks(run_dir, signal.SIGUSR2):
            raise DrillError(f"usr2: {self.launcher.status_label(run_dir)} could not be signalled")
        inj.target = self.launcher.status_label(run_dir)
        if self.drill.resume_with:
            self.drill._relaunch_after_saved_stop(self.run, self.log, attempt, self.deadline)

    def nodekill(self, inj: Injection, state: dict[int, dict[str, Any]]) -> None:
        """End the node that runs RANK (without a rank: the last rank whose node can be killed)."""
        ranks = [inj.rank] if inj.rank is not None else sorted(state, reverse=True)
        errors = []
        for rank in ranks:
            try:
                inj.target = self.launcher.kill_node(self.run.run_dir, rank)
                inj.rank = rank
                return
            except (ValueError, RuntimeError) as exc:
                errors.append(str(exc))
        raise DrillError(f"nodekill: no node could be killed ({'; '.join(errors[:3])})")


def _rank0_steps(run_dir: Path) -> list[tuple[float, int]]:
    """(time, step) of every step rank 0 logged in ``metrics.jsonl``, in time order (streamed: the
    file may hold GBs)."""
    lines: list[tuple[float, int]] = []
    for line in metric_lines(files.metrics_file(run_dir)):
        try:
            rec = json.loads(line)
            if isinstance(rec, dict) and rec.get("rank") == 0 and is_int(rec.get("step")):
                lines.append((float(rec["time"]), rec["step"]))
        except (ValueError, KeyError, TypeError, RecursionError):
            continue
    return sorted(lines)


def _step_time(lines: list[tuple[float, int]]) -> float:
    """The median time of one ordinary step (between consecutive steps)."""
    gaps = sorted(b[0] - a[0] for a, b in itertools.pairwise(lines) if b[1] == a[1] + 1)
    return gaps[len(gaps) // 2] if gaps else 0.0


def _resumed_after(inj: Injection, markers: list[dict[str, Any]]) -> tuple[float, int] | None:
    """(when the attempt after ``inj`` started, the last step of the attempt ``inj`` ended); None
    when no later attempt followed it or the ended one recorded no step."""
    later = [m for m in markers if inj.at is not None and (m.get("started_at") or 0) > inj.at]
    if not later or later[0]["attempt"] == 0:
        return None
    previous = later[0]["attempt"] - 1
    last = markers[previous].get("last_step") if previous < len(markers) else None
    return None if last is None else (later[0]["started_at"], last)


def _lost_to(
    inj: Injection,
    markers: list[dict[str, Any]],
    lines: list[tuple[float, int]],
    step_s: float,
) -> float | None:
    """The wall time lost to ``inj``: from the last step of the attempt it ended to the step after
    it in the next attempt, less one ordinary step; None when the records do not show both."""
    resumed = _resumed_after(inj, markers)
    if resumed is None:
        return None
    started, last = resumed
    before = [t for t, s in lines if t < started and s == last]
    after = [t for t, s in lines if t >= started and s >= last + 1]
    if not (before and after):
        return None
    return round(max(0.0, min(after) - max(before) - step_s), 3)


def _time_lost(run_dir: Path, injections: list[Injection]) -> None:
    """Per injection: the wall time the run lost to it.

    That is: from when the interrupted attempt reached its last step until the next attempt
    reached the step after it (rank 0's ``metrics.jsonl``), less one ordinary step: the
    downtime (stop, restart or requeue, start-up, loading) plus the steps done twice.
    """
    lines = _rank0_steps(run_dir)
    if not lines:
        return
    step_s = _step_time(lines)
    markers = attempts.collect(run_dir)
    for inj in injections:
        lost = _lost_to(inj, markers, lines, step_s)
        if lost is not None:
            inj.time_lost_s = lost


def _rank0(run_dir: Path) -> tuple[RunRecord | None, dict[str, Any]]:
    try:
        record = RunRecord.read(run_dir)
    except RecordError:
        return None, {}
    res = (record.results.get("0") if record is not None else None) or {}
    return record, res if isinstance(res, dict) else {}


def verdict(
    drill: Drill, reference: _Run, interrupted: _Run, injections: list[Injection]
) -> dict[str, Any]:
    """The summary (``drill.json``): both runs' facts, each injection, and whether the results are
    identical."""
    ref_rec, ref = _rank0(reference.run_dir)
    int_rec, got = _rank0(interrupted.run_dir)
    ok = all(r is not None and r.status is Status.OK for r in (ref_rec, int_rec))
    missing = [k for k in COMPARED if k not in ref]
    identical = ok and not missing and all(ref.get(k) == got.get(k) for k in COMPARED)
    attempts = int_rec.attempts if int_rec is not None else []

    def side(run: _Run, rec: RunRecord | None, res: dict[str, Any]) -> dict[str, Any]:
        return {
            "run_dir": str(run.run_dir),
            "status": None if rec is None else str(rec.status),
            "launches": run.launches,
            "exit_codes": run.exit_codes,
            "wall_s": round(run.wall_s, 3),
            **{k: res.get(k) for k in COMPARED},
        }

    summary = {
        "backend": drill.backend,
        "overrides": redact_overrides(drill.overrides),
        "identical": identical,
        "compared": list(COMPARED),
        "missing": missing,
        "reference": side(reference, ref_rec, ref),
        "interrupted": side(interrupted, int_rec, got),
        "injections": [asdict(i) for i in injections],
        "attempts": attempts,
        "time_lost_s": round(interrupted.wall_s - reference.wall_s, 3),
    }
    if drill.atol is not None:
        tolerance = drill_layout.compare_within(
            ref, got, reference.run_dir, interrupted.run_dir, drill.atol
        )
        tolerance["within"] = tolerance["within"] and ok
        summary.update(resume_with=drill.resume_with, tolerance=tolerance)
    return summary


def render(summary: dict[str, Any]) -> str:
    """The verdict as text."""
    ref, got = summary["reference"], summary["interrupted"]
    word = "IDENTICAL" if summary["identical"] else "NOT IDENTICAL"
    lines = [f"drill verdict: {word} ({', '.join(summary['compared'])})"]
    if "tolerance" in summary:
        lines = drill_layout.render_tolerance(summary["tolerance"])
        lines.append(
            f"  bitwise: {word.lower()}; relaunched with {' '.join(summary['resume_with']) or '-'}"
        )
    for name, s in (("reference", ref), ("interrupted", got)):
        lines.append(
            f"  {name:<11} {s['status']}, {s['launches']} launch(es), {s['wall_s']:.1f} s, "
            f"weights_sha256={str(s['weights_sha256'])[:16]}..., final_loss={s['final_loss']}"
        )
    if summary["missing"]:
        lines.append(
            f"  the reference's rank 0 returned no {summary['missing']}: nothing to compare"
        )
    lines.append(f"  attempts made: {len(summary['attempts'])}")
    lines += [f"    {line}" for line in attempts.describe(summary["attempts"])]
    for i in summary["injections"]:
        lost = "?" if i["time_lost_s"] is None else f"{i['time_lost_s']:.2f} s"
        lines.append(
            f"  {i['kind']} at step {i['reached_step']} ({i['target']}): time lost {lost} "
            "(downtime + steps done twice)"
        )
    lines.append(f"  wall-clock difference: {summary['time_lost_s']:+.1f} s")
    return "\n".join(lines)


# ------------------------------------------------------------------ CLI
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m wf_launch.drill",
        description="Run a task twice (uninterrupted, then with injected preemptions or rank "
        "kills) and check that rank 0's weights_sha256 and final_loss are identical. Exit code 0 "
        "only if they are.",
        epilog="examples:\n  python -m wf_launch.drill task=train engine.cp_size=2 "
        "engine.dp_size=2 task.steps=20 task.checkpoint_every=4 --inject kill9@6,sigterm@12\n"
        "  python -m wf_launch.drill task=train launcher.address=HEAD:6379 launcher.nodes=2 "
        "engine.dp_size=4 task.steps=20 --backend ray --inject kill9@4,nodekill@8\n"
        "  python -m wf_launch.drill task=train launcher.nodes=2 engine.dp_size=2 "
        "task.steps=20 --backend slurm --inject usr2@10",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides of the run (not hydra.run.dir, launcher=, "
        "launcher.resume / overwrite / wait: the drill sets those)",
    )
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--inject",
        metavar="SPEC",
        help="comma-separated KIND@STEP: kill9[:RANK]@STEP and "
        "sigterm@STEP (local), usr2@STEP (slurm), kill9[:RANK]@STEP and nodekill[:RANK]@STEP "
        "(ray); under ft=torchft kill9:replicaK@STEP, kill9:replicaK.rankR@STEP, "
        "hang:replicaK@STEP, kill9:replicaK@heal, nodekill:replicaK@STEP (ray) and "
        "lighthouse@STEP",
    )
    how.add_argument(
        "--random",
        metavar="N",
        type=int,
        help="N interruptions of the backend's kinds at random steps (default: 2)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of --random (default 0)")
    p.add_argument(
        "--backend",
        choices=backends(),
        default="local",
        help="where the runs go (default local)",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="the drill directory (default drills/TIMESTAMP)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds each run may take (default 1800)",
    )
    p.add_argument(
        "--resume-with",
        metavar="OVERRIDES",
        default=None,
        help="Hydra overrides every relaunch of the interrupted run adds, e.g. 'engine.dp_size=2 "
        "engine.cp_size=2': it resumes at that layout (needs a sigterm@ locally, usr2@ on slurm)",
    )
    p.add_argument(
        "--atol",
        type=float,
        default=None,
        help="compare loss curve, final loss and final weights within this absolute tolerance "
        f"instead of bitwise (default with --resume-with: {drill_layout.DEFAULT_ATOL:g})",
    )
    p.add_argument(
        "--no-reference",
        action="store_true",
        help="ft=torchft only: skip the reference run, and with it the check of the final loss "
        "against it (the checks of the survivors, the rejoin and the weights stand on the "
        "interrupted run): half the drill's time",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check the arguments and the injections against the "
        "task's config, print the plan, run nothing",
    )
    return p


def _check_overrides(overrides: list[str]) -> None:
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if o.startswith("-"):
            raise DrillError(
                f"{o!r}: unknown option (see --help); Hydra's -m sweeps are not drilled"
            )
        if "=" not in o:
            raise DrillError(f"{o!r}: not a Hydra override (KEY=VALUE)")
        if key in OWNED:
            raise DrillError(f"{o!r}: the drill sets {key} itself (use --backend / --dir)")


def _plan(
    args: argparse.Namespace,
) -> tuple[list[str], list[Injection] | None, list[str], float | None]:
    """The checked overrides (with what the drill adds), injections (None: random, after the
    reference run), ``--resume-with``'s overrides and the tolerance."""
    _check_overrides(args.overrides)
    if args.no_reference:
        raise DrillError(
            "--no-reference: only under ft=torchft (without ft, the comparison with the "
            "reference run is the drill's check)"
        )
    injections = parse_injections(args.inject, args.backend) if args.inject else None
    resume_with, atol = _layout_options(args, injections)
    if args.random is not None and args.random < 1:
        raise DrillError(f"--random {args.random}: expected an integer >= 1")
    if args.timeout <= 0:
        raise DrillError(f"--timeout {args.timeout}: expected seconds > 0")
    task = composed_task([f"launcher={args.backend}", *args.overrides])
    if injections is None and isinstance(task.get("steps"), int):
        injections = random_injections(args.random or 2, task["steps"], args.backend, args.seed)
    given = {o.split("=", 1)[0].lstrip("+~") for o in args.overrides}
    extra, notes = check_injections(injections, task, given) if injections else ([], [])
    for note in notes:
        print(f"drill: {note}", flush=True)
    return [*args.overrides, *extra], injections, resume_with, atol


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with terminated_as_exit():
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    if wants_ft(args.overrides):
        return _ft_drill(args)
    try:
        overrides, injections, resume_with, atol = _plan(args)
        if args.dry_run:
            print(_dry_run_text(args.backend, overrides, injections, resume_with))
            return 0
        directory = (args.dir or Path("drills") / time.strftime("%Y%m%d-%H%M%S")).absolute()
        held = _claim(directory)
    except DrillError as exc:
        print(f"wf_launch.drill: {exc}", file=sys.stderr)
        return 2
    with held:
        return _drill(args, directory, overrides, injections, resume_with, atol)


FT_BACKENDS = ("local", "ray", "slurm")


def _ft_drill(args: argparse.Namespace) -> int:
    """``ft=torchft``: kill a rank of one replica group (:mod:`.drill_ft`)."""
    try:
        _check_overrides(args.overrides)
        if not args.inject or args.backend not in FT_BACKENDS or args.resume_with:
            raise DrillError(
                "ft=torchft: give --inject KIND:replicaK@STEP (e.g. kill9:replica1@8), on "
                f"--backend {' or '.join(FT_BACKENDS)}, without --random or --resume-with"
            )
        if args.no_reference and args.atol is not None:
            raise DrillError(
                f"--atol {args.atol} with --no-reference: the tolerance is of the final loss "
                "against the reference run, which --no-reference skips"
            )
        reference = not args.no_reference
        # bad injections: before any file
        plan = describe_ft_drill(args.overrides, args.inject, args.backend, reference)
        if args.dry_run:
            print(plan)
            return 0
        directory = (args.dir or Path("drills") / time.strftime("%Y%m%d-%H%M%S")).absolute()
        held = _claim(directory)
    except (DrillError, FtDrillError) as exc:
        print(f"wf_launch.drill: {exc}", file=sys.stderr)
        return 2
    with held:
        try:
            return run_ft_drill(
                args.overrides,
                args.inject,
                directory,
                args.timeout,
                args.atol,
                args.backend,
                reference,
            )
        except FtDrillError as exc:
            print(f"wf_launch.drill: {exc}", file=sys.stderr)
            return 2


def _claim(directory: Path) -> RunDirClaim:
    """The drill's directory, owner-only and locked for this drill (one drill holds it)."""
    private_umask()
    if directory.is_dir() and _holds_files(directory):
        raise DrillError(f"--dir {directory}: not empty (a drill directory holds one drill)")
    try:
        held = claim_tool_dir(directory, "--dir")
    except RunDirInUse as exc:
        raise DrillError(str(exc)) from None
    if _holds_files(directory):
        held.release()
        raise DrillError(f"--dir {directory}: not empty (another drill started there first)")
    return held


def _holds_files(directory: Path) -> bool:
    return any(p.name != files.LOCK for p in directory.iterdir())


def _drill(
    args: argparse.Namespace,
    directory: Path,
    overrides: list[str],
    injections: list[Injection] | None,
    resume_with: list[str],
    atol: float | None,
) -> int:
    """The reference run, the interrupted one, and their comparison; the drill's exit code."""
    try:
        drill = Drill(
            overrides,
            args.backend,
            directory,
            args.timeout,
            resume_with=resume_with,
            atol=atol,
        )
        reference, interrupted, injections = _run_both(drill, args, injections)
    except DrillError as exc:
        print(f"wf_launch.drill: {exc}", file=sys.stderr)
        return 2
    summary = verdict(drill, reference, interrupted, injections)
    atomic_write_json(drill.dir / "drill.json", summary)
    print(render(summary), flush=True)
    if "tolerance" in summary:
        return 0 if summary["tolerance"]["within"] else 1
    return 0 if summary["identical"] else 1


def _dry_run_text(
    backend: str,
    overrides: list[str],
    injections: list[Injection] | None,
    resume_with: list[str],
) -> str:
    """What ``--dry-run`` prints: the command run twice, the interruptions, the relaunch."""
    planned = (
        "random, after the reference run"
        if injections is None
        else ", ".join(f"{i.kind}@{i.step}" for i in injections)
    )
    relaunch = f"; relaunches add {' '.join(resume_with)}" if resume_with else ""
    return (
        f"drill (dry run): python -m wf_launch {' '.join(redact_overrides(overrides))} "
        f"launcher={backend}, twice; "
        f"interruptions: {planned}{relaunch}"
    )


def _drill_dir(given: Path | None) -> Path:
    """The drill directory (``--dir``, else ``drills/TIMESTAMP``), made; refused when not empty."""
    directory = given or Path("drills") / time.strftime("%Y%m%d-%H%M%S")
    if directory.exists() and any(directory.iterdir()):
        raise DrillError(f"--dir {directory}: not empty (a drill directory holds one drill)")
    directory.mkdir(parents=True, exist_ok=True)
    return directory.absolute()


def _run_both(
    drill: Drill, args: argparse.Namespace, injections: list[Injection] | None
) -> tuple[_Run, _Run, list[Injection]]:
    """The reference run, then the interrupted one (random injections drawn once the reference
    run has told the task's length)."""
    print(f"drill: reference run in {drill.dir / 'reference'}", flush=True)
    reference = drill.reference()
    if reference.exit_codes[-1] != 0:
        raise DrillError(
            f"the reference run failed (exit code {reference.exit_codes[-1]}); "
            f"see {drill.dir / 'reference.log'}"
        )
    if injections is None:
        total = _total_steps(reference.run_dir)
        injections = random_injections(args.random or 2, total, args.backend, args.seed)
    print(
        f"drill: interrupted run in {drill.dir / 'interrupted'}: "
        f"{', '.join(f'{i.kind}@{i.step}' for i in injections)}",
        flush=True,
    )
    return reference, drill.interrupted(injections), injections


def _layout_options(
    args: argparse.Namespace, injections: list[Injection] | None
) -> tuple[list[str], float | None]:
    """``--resume-with`` as overrides (checked like the run's) and the tolerance (``--atol``, or the
    default)."""
    try:
        resume_with = drill_layout.parse_resume_with(
            args.resume_with,
            args.backend,
            None if injections is None else [i.kind for i in injections],
        )
    except ValueError as exc:
        raise DrillError(str(exc)) from None
    _check_overrides(resume_with)
    if args.atol is not None and not (args.atol > 0 and args.atol != float("inf")):
        raise DrillError(f"--atol {args.atol}: expected a finite tolerance > 0")
    return resume_with, args.atol if args.atol is not None else (
        drill_layout.DEFAULT_ATOL if resume_with else None
    )


def _total_steps(run_dir: Path) -> int:
    totals = [s.get("total") for s in read_progress(run_dir, _world_size(run_dir)).values()]
    totals = [t for t in totals if isinstance(t, int)]
    if not totals:
        raise DrillError(
            "--random: the reference run published no total (ctx.progress(step, total)); "
            "pass --inject KIND@STEP instead"
        )
    return max(totals)


if __name__ == "__main__":
    sys.exit(main())
