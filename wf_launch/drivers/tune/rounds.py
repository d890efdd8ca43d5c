"""One round of a tune: its trials as one ``python -m wf_launch -m`` sweep, watched while it runs.

Each trial is a config file, ``DIR/conf/wf_tune_trial/<id>.yaml`` (its engine sizes and
``--also`` values), so a round is one Hydra sweep over ``+wf_tune_trial=<id>,<id>,...``
with the user's overrides and the round's length (``task.steps=N``): the same launch
path as any sweep, through whichever launcher the overrides pick (a SLURM round's trials
go out as job arrays, each point with its own allocation). The round's sweep directory
is ``DIR/rounds/r<R>``; its console output ``DIR/rounds/r<R>.log``.

While the sweep runs the tuner watches its points: a trial whose ranks report no
progress for ``--stall-s`` has its stacks dumped and is stopped (recorded as stalled,
with where its ranks were); the budget and Ctrl-C / SIGTERM stop the sweep the way a
terminal would (the running point is interrupted, the sweep's report written).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ...rank.progress import STEPS_ENV
from ...rundir import files
from ...rundir.io import atomic_write_text, open_log, read_yaml
from ...rundir.pids import die_with_parent
from ...rundir.record import RecordError, RunRecord
from .measure import NO_METRIC, Measurement, measure_point
from .space import override_key
from .stall import last_activity, stop_stalled

__all__ = [
    "TRIAL_GROUP",
    "Interrupt",
    "RoundOutcome",
    "RoundRunner",
    "sweep_argv",
    "write_trial_configs",
]

TRIAL_GROUP = "wf_tune_trial"
"""The config group of trial files: a round sweeps ``+wf_tune_trial=...``."""
DONE, BUDGET, INTERRUPTED, NO_METRIC_STOP, SWEEP_FAILED = (
    "done",
    "budget",
    "interrupted",
    "no_metric",
    "sweep_failed",
)
_TRIAL_ID = re.compile(r"t[0-9]+(-[A-Za-z0-9_]+)*")


@dataclass
class Interrupt:
    """Set by the tune's signal handlers: the signal to pass on to the round's sweep, and how many
    came (a second one stops the sweep at once)."""

    signum: int | None = None
    count: int = 0

    def __call__(self, signum: int, frame: Any = None) -> None:
        self.signum = signum
        self.count += 1


@dataclass
class RoundOutcome:
    """How a round ended: ``done``, ``budget`` (cut), ``interrupted``, ``no_metric``,
    ``sweep_failed``."""

    status: str
    measurements: list[Measurement] = field(default_factory=list)
    message: str = ""
    exit_code: int | None = None


def _value(override: str) -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(override).value()


def write_trial_configs(tune_dir: Path, trials: list[dict[str, Any]]) -> Path:
    """One ``# @package _global_`` config per trial (its overrides as YAML); returns the search-path
    folder."""
    conf = tune_dir / files.TUNE_CONF
    group = conf / TRIAL_GROUP
    group.mkdir(parents=True, exist_ok=True)
    for trial in trials:
        nested: dict[str, Any] = {}
        for override in trial["overrides"]:
            *parents, leaf = override_key(override).split(".")
            node = nested
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = _value(override)
        if not _TRIAL_ID.fullmatch(trial["id"]):
            raise ValueError(f"trial id {trial['id']!r}: not a tuner's trial id")
        label = json.dumps(trial["label"])  # one line, whatever it holds
        text = f"# @package _global_\n# trial {trial['id']}: {label}\n" + yaml.safe_dump(nested)
        atomic_write_text(group / f"{trial['id']}.yaml", text)
    return conf


def _searchpath(overrides: list[str], conf: Path) -> tuple[list[str], str]:
    """The user's overrides without ``hydra.searchpath``, and one that adds the trial configs to
    theirs."""
    rest, paths = [], []
    for o in overrides:
        if override_key(o) == "hydra.searchpath":
            value = _value(o)
            paths += list(value) if isinstance(value, list) else [value]
        else:
            rest.append(o)
    paths.append(f"file://{conf}")
    return rest, "hydra.searchpath=[" + ",".join(str(p) for p in paths) + "]"


def sweep_argv(
    tune_dir: Path,
    round_index: int,
    trials: list[str],
    steps: int,
    overrides: list[str],
    steps_field: str,
    launcher: str = "local",
) -> list[str]:
    """The round's command: ``python -m wf_launch -m OVERRIDES +wf_tune_trial=a,b task.steps=N
    ...``.

    On SLURM every trial asks for nodes of its own (``--exclusive``) unless the overrides say
    otherwise:
    trials of a round run as array points, at once, and must not share a node's cores. On Ray a
    cluster
    (``launcher.address``) runs them side by side, each holding its ranks' CPUs; with a private
    instance on
    this machine (no address) they run one after another (Hydra's basic launcher), so that no trial
    is
    measured while another uses the same cores.
    """
    rest, searchpath = _searchpath(overrides, tune_dir / files.TUNE_CONF)
    rest = [o for o in rest if override_key(o) != f"task.{steps_field}"]
    keys = {override_key(o) for o in rest}
    quiet = [] if "launcher.console_ranks" in keys else ["launcher.console_ranks=[]"]
    if launcher == "slurm" and not any(k.startswith("launcher.sbatch_extra") for k in keys):
        quiet.append("++launcher.sbatch_extra.exclusive=''")
    private_ray = launcher == "ray" and not any(
        override_key(o) == "launcher.address" and o.split("=", 1)[1] not in ("", "null")
        for o in rest
    )
    if private_ray and "hydra/launcher" not in keys:
        quiet.append("hydra/launcher=basic")
    return [
        sys.executable,
        "-m",
        "wf_launch",
        "-m",
        *rest,
        *quiet,
        searchpath,
        f"+{TRIAL_GROUP}={','.join(trials)}",
        f"task.{steps_field}={steps}",
        f"hydra.sweep.dir={files.tune_round_dir(tune_dir, round_index)}",
        "hydra.callbacks.sweep_report.exit_nonzero=false",
        "hydra.callbacks.sweep_report.chart=false",
    ]


def trial_of(job_dir: Path) -> str | None:
    """The trial a sweep point ran (its ``+wf_tune_trial=`` override), or None."""
    try:
        overrides = read_yaml(files.hydra_overrides(job_dir)) or []
    except (OSError, ValueError):
        return None
    for o in overrides:
        if isinstance(o, str) and override_key(o) == TRIAL_GROUP:
            return o.split("=", 1)[1]
    return None


def job_dirs(round_dir: Path, cache: dict[str, str] | None = None) -> dict[str, Path]:
    """trial id -> its point directory in the round's sweep directory (``cache``: point name ->
    trial, kept between calls: a point's trial never changes)."""
    cache = {} if cache is None else cache
    out: dict[str, Path] = {}
    if round_dir.is_dir():
        for d in sorted(round_dir.iterdir()):
            if (
                d.name.isdigit()
                and d.name not in cache
                and d.is_dir()
                and (trial := trial_of(d)) is not None
            ):
                cache[d.name] = trial
            if d.name in cache:
                out[cache[d.name]] = d
    return out


@dataclass
class Watch:
    """How a round is watched: the metric and warm-up (to measure), ``stall_s``, the budget's
    ``deadline`` (monotonic, or None), ``check_metric`` (stop at the first trial that measures
    nothing), the launcher."""

    metric: str
    warmup: int
    stall_s: float
    deadline: float | None
    check_metric: bool
    launcher: str
    poll_s: float = 0.25


class RoundRunner:
    """Run one round's sweep and watch it; ``on_measure`` hears of each trial as it ends (``known``:
    trials measured before a resume, kept as they are)."""

    def __init__(
        self,
        tune_dir: Path,
        round_index: int,
        trials: list[dict[str, Any]],
        steps: int,
        argv: list[str],
        watch: Watch,
        interrupt: Interrupt,
        on_measure: Callable[[Measurement], None],
        known: dict[str, Measurement] | None = None,
    ) -> None:
        self.dir = tune_dir
        self.index = round_index
        self.trials = {t["id"]: t for t in trials}
        self.steps = steps
        self.argv = argv
        self.watch = watch
        self.interrupt = interrupt
        self.on_measure = on_measure
        self.round_dir = files.tune_round_dir(tune_dir, round_index)
        self.stalled: dict[str, str] = {}
        self.done: dict[str, Measurement] = dict(known or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._names: dict[str, str] = {}

    def run(self) -> RoundOutcome:
        log = files.tune_round_log(self.dir, self.index)
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, STEPS_ENV: "1"}
        with os.fdopen(open_log(log), "ab") as out:  # owner-only: a round's console output
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=lambda: die_with_parent(signal.SIGTERM),
            )
        status, message = DONE, ""
        try:
            status, message = self._watch()
        finally:
            code = self._wait()
        if status == DONE and code not in (0, None):
            status, message = SWEEP_FAILED, f"the round's sweep exited with code {code}; see {log}"
        return RoundOutcome(status, self._measure_all(), message, code)

    def _watch(self) -> tuple[str, str]:
        assert self.proc is not None
        while self.proc.poll() is None:
            if self.interrupt.signum is not None:
                self._stop(self.interrupt.signum)
                return INTERRUPTED, f"interrupted by {signal.Signals(self.interrupt.signum).name}"
            if self.watch.deadline is not None and time.monotonic() > self.watch.deadline:
                self._stop(signal.SIGINT)
                return BUDGET, "--budget-s spent"
            stop = self._poll_points()
            if stop:
                self._stop(signal.SIGINT)
                return NO_METRIC_STOP, stop
            time.sleep(self.watch.poll_s)
        self._poll_points()
        return DONE, ""

    def _stop(self, signum: int) -> None:
        """Stop the sweep as a terminal would: SIGINT to its process group; SIGTERM to the sweep
        itself."""
        assert self.proc is not None
        try:
            if signum == signal.SIGINT:
                os.killpg(self.proc.pid, signal.SIGINT)
            else:
                os.kill(self.proc.pid, signum)
        except ProcessLookupError:
            pass

    def _wait(self, grace_s: float = 120.0) -> int | None:
        """The sweep's exit code; after ``grace_s``, or at a second Ctrl-C / SIGTERM, its process
        group is killed."""
        assert self.proc is not None
        deadline, seen = time.monotonic() + grace_s, self.interrupt.count
        while self.proc.poll() is None:
            if time.monotonic() > deadline or self.interrupt.count > max(seen, 1):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                return self.proc.wait()
            time.sleep(0.1)
        return self.proc.returncode

    def _poll_points(self) -> str:
        """Measure the trials that ended since the last poll, stop stalled ones; a reason to stop
        the round, or ''."""
        for trial, job_dir in job_dirs(self.round_dir, self._names).items():
            if trial in self.done or trial not in self.trials:
                continue
            try:
                record = RunRecord.read(job_dir)
            except RecordError:
                record = None
            if record is not None and record.final:
                m = self._measure(trial, job_dir)
                self.done[trial] = m
                self.on_measure(m)
                if m.status == NO_METRIC and self.watch.check_metric:
                    return m.cause
            elif trial not in self.stalled and files.config_path(job_dir).exists():
                self._check_stall(trial, job_dir)
        return ""

    def _measure(self, trial: str, job_dir: Path | None) -> Measurement:
        if job_dir is None:
            return Measurement(trial, self.index, "not_run", steps=self.steps)
        return measure_point(
            job_dir,
            trial,
            self.index,
            self.watch.metric,
            self.watch.warmup,
            self.steps,
            self.stalled.get(trial),
            self.trials[trial]["sizes"],
        )

    def _measure_all(self) -> list[Measurement]:
        dirs = job_dirs(self.round_dir)
        out = []
        for trial in self.trials:
            m = self.done.get(trial) or self._measure(trial, dirs.get(trial))
            out.append(m)
        return out

    def _check_stall(self, trial: str, job_dir: Path) -> None:

        world = self.trials[trial]["world_size"]
        since = last_activity(job_dir, world, local=self.watch.launcher == "local")
        if since is not None and time.time() - since > self.watch.stall_s:
            self.stalled[trial] = stop_stalled(
                job_dir, world, self.watch.launcher, self.watch.stall_s
            )
