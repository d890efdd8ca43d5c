"""Fuzz the run-directory files the tools read: ``status``, ``runs``, ``plot`` and the sweep report.

Every example builds small, valid run directories from templates (a local run that
succeeded, a local run that failed after a restart, a detached SLURM run, and a sweep of
two points), then damages one to three of their files: random bytes, a cut, a field given a
hostile value (wrong type, huge or negative number, NaN, control characters, nesting
10 000 deep, a megabyte of text), the whole document swapped for a scalar, a FIFO, a
folder, a link to ``/dev/zero``, a 100 MB sparse file, a stray ``attempt999999999.json``
or a rank file of rank 10**8. Then the tools run in this process on the damaged tree:

* ``python -m wf_launch.status RUN`` (and ``--tail 5``, ``--follow --timeout 0.05``) on each run,
  and on the sweep (which rewrites its report);
* ``python -m wf_launch.runs ROOT`` and ``--json``;
* ``python -m wf_launch.plot``'s reader on each run's ``metrics.jsonl``;
* the sweep report: its points, tables and step chart's reader;
* ``python -m wf_launch.checkpoint list`` (``--json`` too) and ``export`` of a run's
  checkpoint (its ``COMMIT`` and ``.metadata`` damaged like any file);
* a tune's ``tune.json`` read as ``tune --resume`` reads it, the run's ``run_id``, its
  ``overrides.yaml`` (the printed resume command) and the sweep's ``multirun.yaml``;
* a drill directory's verdict (both runs' records, attempts, metrics and, with a tolerance,
  checkpoints) and its text.

Besides damaging a file, an example may swap the run's own folder holding it (``logs/``,
``checkpoints/``, ``step_N/``, ``.hydra/``...) for a link to a copy outside the tree whose
files hold :data:`OUTSIDE_MARKER`.

Each must end (any exit code) within :data:`HANG_CPU_S` of CPU time and :data:`HANG_S` of wall
time: an exception escaping a command is a crash, a command still running at a limit a hang,
and an escape is a control character a run wrote that reaches the output raw (ESC, BEL, C1),
or a file outside the tree read (its marker printed) or written through a link. SLURM's commands are shims that fail at once
(the scheduler knows nothing), so a detached run is judged from its files.

    python scripts/fuzz_rundirs.py --examples 500 [--seed 0]

prints ``N files tried, C crashes, H hangs, E escapes`` and each failure with the damage
that caused it. ``scripts/fuzz_configs.py --rundirs N`` runs it too;
``tests/test_config_fuzz.py`` keeps it at 0, 0 and 0.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HANG_CPU_S = 10.0
"""A command that spends more CPU time than this on one damaged tree is a hang (runaway work).
CPU time, not wall time: on a loaded machine the sweep report's charts alone took over 10 s of
wall time (about 3 s of CPU), which a wall-clock limit called a hang."""
HANG_S = 120.0
"""A command still running after this much wall time is a hang (blocked: a FIFO, a lock)."""
OUTSIDE_MARKER = "OUTSIDE-THE-RUN-DIRECTORY"
"""What the files a link points to outside the tree hold: a tool that prints it read out."""

HOSTILE = [
    None,
    True,
    False,
    0,
    -1,
    5,
    2**31,
    10**30,
    -(10**30),
    1e308,
    float("nan"),
    float("inf"),
    "",
    "x",
    "999999999",
    "\x1b]0;pwned\x07\x1b[2J\x9b31m",
    "a\nb\rc",
    "\u202e\u2028",
    [],
    {},
    [1, "two"],
    {"rank": "x"},
    "y" * (1 << 20),
]
_RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
SHIMS = ("sacct", "squeue", "scontrol", "sbatch", "scancel")


# --------------------------------------------------------------------------- templates


def _config(launcher: str, world: int, task: str = "ticker") -> str:
    return (
        f"engine: {{tp_size: 1, cp_size: 1, pp_size: 1, dp_size: {world}, order: tp-cp-pp-dp, "
        f"distributed_backend: gloo, distributed_timeout_minutes: 1, init_timeout_s: 60}}\n"
        f"launcher: {{name: {launcher}, console_ranks: null, progress_interval_s: 10, "
        "stall_warning_s: 300}\n"
        f"task: {{name: {task}, modules: []}}\n"
    )


def _write(path: Path, text: str | dict | list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if isinstance(text, str) else json.dumps(text))


def _run(
    run_dir: Path, launcher: str, world: int, status: str, final: bool, failed_rank: int | None
) -> None:
    from wf_launch.rundir import files

    now = time.time()
    _write(files.config_path(run_dir), _config(launcher, world))
    record: dict[str, Any] = {
        "status": status,
        "format_version": 1,
        "run_dir": str(run_dir),
        "task": "ticker",
        "launcher": launcher,
        "overrides": [f"engine.dp_size={world}"],
        "layout": {
            "tp": 1,
            "cp": 1,
            "pp": 1,
            "dp": world,
            "order": "tp-cp-pp-dp",
            "world_size": world,
        },
        "results": {str(r): {"steps": 4, "tokens_per_s": 12.5} for r in range(world)}
        if status == "ok"
        else {},
        "timings": {"wall_s": 3.2, "ranks": {"0": {"start_s": 0.1}}},
        "hosts": ["h"],
        "attempts": [{"attempt": 0, "cause": "launch", "last_step": 4}],
        "finished_at": now,
    }
    if final:
        record["exit_code"] = 0 if status == "ok" else 1
    if failed_rank is not None:
        record["failure"] = {
            "rank": failed_rank,
            "coords": {"tp": 0, "cp": 0, "pp": 0, "dp": failed_rank},
            "cause": "exception",
            "type": "ValueError",
            "message": "bad batch 17",
            "log": str(files.rank_log(run_dir, failed_rank)),
        }
        _write(
            files.rank_error(run_dir, failed_rank),
            {
                "rank": failed_rank,
                "coords": {"dp": failed_rank},
                "kind": "exception",
                "type": "ValueError",
                "message": "bad batch 17",
                "traceback": "Traceback ...\nValueError: bad batch 17\n",
                "time": now,
                "host": "h",
                "pid": 4194000,
                "log": "x",
                "attempt": 1,
            },
        )
    _write(run_dir / files.RESULT, record)
    if status != "submitted":
        _write(
            files.metrics_file(run_dir),
            "".join(
                json.dumps({"rank": r, "step": s, "time": now + s, "loss": 1.0 / s}) + "\n"
                for s in range(1, 5)
                for r in range(world)
            ),
        )
    for n in range(2 if failed_rank is not None else 1):
        _write(
            files.attempt_file(run_dir, n),
            {
                "attempt": n,
                "started_at": now,
                "ended_at": now + 1,
                "resumed_from": None if n == 0 else 2,
                "last_step": 4,
                "ended_by": "completed",
            },
        )
    for r in range(world):
        _write(
            files.rank_log(run_dir, r),
            f"12:00:00 | INFO | [r{r} tp0 cp0 pp0 dp{r}] x | tick 1\n" * 3,
        )
        _write(
            files.rank_progress(run_dir, r),
            {
                "rank": r,
                "step": 4,
                "total": 4,
                "time": now,
                "metrics": {"loss": 0.25},
                "pid": 4194000,
            },
        )
        _write(
            files.rank_pid(run_dir, r), {"pid": 4194000, "host": "h", "main_thread": 1, "start": 1}
        )
    _write(run_dir / files.LOCK, "4194000 elsewhere\n")


def _slurm_run(run_dir: Path) -> None:
    from wf_launch.rundir import files

    _run(run_dir, "slurm", 2, "submitted", False, None)
    _write(
        run_dir / files.SLURM_JOB,
        {
            "job_id": "4242",
            "folder": str(run_dir / files.SUBMITIT),
            "submitted_at": time.time(),
            "snapshot": None,
            "nodes": 1,
            "tasks_per_node": 2,
            "world_size": 2,
            "info": {"launcher": "slurm"},
        },
    )
    _write(
        files.rank_preempt(run_dir, 0), {"rank": 0, "restart": 0, "hook": "saved", "requeue": True}
    )


_CHECKPOINT: dict[str, Path] = {}
"""A checkpoint saved once per process (``checkpoints/`` of a one-rank run), copied into each
tree."""


def _checkpoint(run_dir: Path) -> None:
    import warnings

    import torch

    from wf_launch.rank.checkpoint import Checkpointer

    if "src" not in _CHECKPOINT:
        src = Path(tempfile.mkdtemp(prefix="wf-fuzz-ckpt-"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Checkpointer(src).save(3, {"model": torch.nn.Linear(3, 2)})
        _CHECKPOINT["src"] = src
    shutil.copytree(_CHECKPOINT["src"] / "checkpoints", run_dir / "checkpoints")


def _tune(tune_dir: Path) -> None:
    from wf_launch.drivers.tune.space import build_space
    from wf_launch.drivers.tune.state import TuneState

    args = {"world_size": 2, "overrides": ["task=clockwork"], "also": [], "mem_gb": None}
    args |= {"metric": "tokens_per_s", "warmup": 1, "min_steps": 2, "cutoff": 0.3}
    space = [p.to_json() | {"verdict": {"status": "valid"}} for p in build_space(2, [])]
    state = TuneState(tune_dir, args | {"steps_field": "steps"}, full_length=8, space=space)
    state.rounds = [{"index": 0, "steps": 3, "trials": [space[0]["id"]], "status": "running"}]
    tune_dir.mkdir(parents=True, exist_ok=True)
    state.save()


def build(root: Path) -> dict[str, Path]:
    """The template tree under ``root``: name -> run (or sweep, or tune) directory."""
    from wf_launch.rundir import files

    runs = {
        "ok": root / "outputs" / "ok",
        "failed": root / "outputs" / "failed",
        "slurm": root / "outputs" / "slurm",
        "sweep": root / "multirun" / "sweep",
    }
    _run(runs["ok"], "local", 2, "ok", True, None)
    _run(runs["failed"], "local", 2, "failed", True, 1)
    _slurm_run(runs["slurm"])
    for n in range(2):
        point = runs["sweep"] / str(n)
        _run(point, "local", n + 1, "ok", True, None)
        _write(files.hydra_config(point), _config("local", n + 1))
        _write(files.hydra_job(point), f"hydra: {{job: {{num: {n}}}}}\n")
        _write(files.hydra_overrides(point), f"- engine.dp_size={n + 1}\n")
    _write(
        runs["sweep"] / files.SWEEP_PLAN, "hydra:\n  overrides:\n    task: [engine.dp_size=1,2]\n"
    )
    _write(files.run_id_file(runs["ok"]), "20261203-101500-3f9a2c1b\n")
    _write(runs["ok"] / files.OVERRIDES, "- engine.dp_size=2\n- task.kwargs.api_token=x\n")
    _checkpoint(runs["ok"])
    runs["tune"] = root / "tunes" / "t"
    _tune(runs["tune"])
    runs["drill"] = root / "drills" / "d"
    _drill(runs["drill"])
    return runs


def _drill(drill_dir: Path) -> None:
    """A drill that ended: its two runs (one restarted once), their logs, its verdict."""
    from wf_launch.rundir import files

    _run(drill_dir / "reference", "local", 1, "ok", True, None)
    _run(drill_dir / "interrupted", "local", 1, "ok", True, None)
    _write(files.attempt_file(drill_dir / "interrupted", 1), {"attempt": 1, "resumed_from": 2})
    for name in ("reference", "interrupted"):
        _write(drill_dir / f"{name}.log", "drill: run\n")
    _write(drill_dir / "drill.json", {"identical": True, "compared": ["loss_hash"]})


# --------------------------------------------------------------------------- damage


def _leaves(doc: Any, path: tuple = ()) -> Iterator[tuple]:
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield (*path, key)
            yield from _leaves(value, (*path, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc[:3]):
            yield (*path, i)
            yield from _leaves(value, (*path, i))


def _set(doc: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def _hostile(rng: random.Random) -> Any:
    if rng.random() < 0.05:
        deep: Any = 1
        for _ in range(10_000):
            deep = [deep]
        return deep
    return rng.choice(HOSTILE)


def _field(path: Path, rng: random.Random) -> str:
    """Give one field of a JSON or YAML file a hostile value (or swap the whole document)."""
    import yaml

    text = path.read_text()
    doc = yaml.safe_load(text) if path.suffix == ".yaml" else json.loads(text)
    leaves = list(_leaves(doc))
    if not leaves or rng.random() < 0.15:
        doc, where = _hostile(rng), "the document"
    else:
        leaf = rng.choice(leaves)
        where = ".".join(map(str, leaf))
        _set(doc, leaf, _hostile(rng))
    try:
        out = yaml.safe_dump(doc) if path.suffix == ".yaml" else json.dumps(doc)
    except (RecursionError, ValueError):
        out = "[" * 100_000
    path.write_text(out)
    return f"field {where}"


def damage(path: Path, rng: random.Random) -> str:
    """Damage the file at ``path`` one way, picked at random; what was done."""
    kind = rng.choice(
        [
            "garbage",
            "cut",
            "field",
            "field",
            "field",
            "field",
            "fifo",
            "folder",
            "devzero",
            "sparse",
            "controls",
        ]
    )
    if kind in ("field", "controls") and path.suffix not in (".json", ".yaml"):
        kind = "garbage"
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        if kind == "field":
            try:
                return _field(path, rng)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                kind = "garbage"
        if kind == "controls":
            path.write_text(
                path.read_text()
                .replace("bad batch", "\x1b]0;pwned\x07\x1b[2Jbad\x9b1m batch")
                .replace("ticker", "tick\x1b[31mer")
                .replace("tick 1", "tick\x1b[2J 1")
            )
            return "control characters"
        if kind == "cut":
            data = path.read_bytes()
            path.write_bytes(data[: rng.randrange(len(data) + 1)])
            return "cut"
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "devzero":
        os.symlink("/dev/zero", path)
    elif kind == "sparse":
        with open(path, "wb") as f:
            f.truncate(100 << 20)
    else:
        kind = "garbage"
        path.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))))
    return kind


def link_folder(path: Path, outside: Path) -> str:
    """Swap the run's own folder holding ``path`` (``logs/``, ``checkpoints/``...) for a link to
    a copy of it outside the tree, every file there holding :data:`OUTSIDE_MARKER`."""
    from wf_launch.rundir.files import is_own_folder

    folder = path.parent
    while folder.name and not is_own_folder(folder.name):
        folder = folder.parent
    if not folder.name:
        return damage(path, random.Random(0))
    target = outside / f"{folder.name}-{len(list(outside.iterdir()))}"
    shutil.copytree(folder, target, symlinks=True)
    for f in target.rglob("*"):
        if f.is_file() and not f.is_symlink():
            f.write_text(f"{OUTSIDE_MARKER}\n")
    shutil.rmtree(folder)
    folder.symlink_to(target)
    return f"folder {folder.name}/ linked out of the tree"


def _outside_state(outside: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(outside.rglob("*")) if p.is_file()}


def _candidates(runs: dict[str, Path]) -> list[Path]:
    found = [p for d in runs.values() for p in d.rglob("*") if p.is_file() or p.is_fifo()]
    return sorted(set(found))


def _extra(run_dir: Path, rng: random.Random) -> tuple[Path, str]:
    """A file a run should not have: a huge attempt number, a rank file of rank 10**8."""
    from wf_launch.rundir import files

    choice = rng.choice(["attempt", "attempt_long", "rank_pid", "rank_progress", "rank_log"])
    if choice == "attempt":
        path = files.attempt_file(run_dir, 999_999_999)
    elif choice == "attempt_long":
        path = files.attempt_file(run_dir, 0).with_name("attempt" + "9" * 200 + ".json")
    else:
        path = {
            "rank_pid": files.rank_pid,
            "rank_progress": files.rank_progress,
            "rank_log": files.rank_log,
        }[choice](run_dir, 10**8)
    _write(path, {"attempt": 1, "last_step": 3, "pid": 4194000, "step": 1, "host": "h"})
    return path, f"stray {path.name}"


# --------------------------------------------------------------------------- running the tools


class _Hang(Exception):
    pass


@contextlib.contextmanager
def _limit(cpu_s: float, wall_s: float) -> Iterator[None]:
    """Raise :class:`_Hang` after ``cpu_s`` of this process's CPU time or ``wall_s`` of wall
    time, whichever comes first."""

    def fire(signum: int, frame: object) -> None:
        raise _Hang("CPU" if signum == signal.SIGPROF else "wall")

    old = {sig: signal.signal(sig, fire) for sig in (signal.SIGALRM, signal.SIGPROF)}
    signal.setitimer(signal.ITIMER_PROF, cpu_s)
    signal.setitimer(signal.ITIMER_REAL, wall_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.setitimer(signal.ITIMER_PROF, 0)
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _commands(runs: dict[str, Path], root: Path) -> list[tuple[str, Callable[[], Any]]]:
    from wf_launch.readers import plot, status
    from wf_launch.readers import runs as runs_tool
    from wf_launch.readers.sweep.charts import render_charts  # noqa: F401  (as the report does)
    from wf_launch.readers.sweep.points import collect_points
    from wf_launch.readers.sweep.tables import render_csv, render_markdown

    commands: list[tuple[str, Callable[[], Any]]] = []
    for name in ("ok", "failed", "slurm"):
        d = runs[name]
        commands += [
            (f"status {name}", lambda d=d: status.main([str(d)])),
            (f"status --tail {name}", lambda d=d: status.main([str(d), "--tail", "5"])),
            (
                f"status --follow {name}",
                lambda d=d: status.main([str(d), "--follow", "--timeout", "0.05"]),
            ),
            (f"plot reader {name}", lambda d=d: plot.load_metrics(d)),
        ]
    commands += _record_commands(runs, root)
    commands += [
        ("status sweep", lambda: status.main([str(runs["sweep"])])),
        ("runs", lambda: runs_tool.main([str(root / "outputs"), str(root / "multirun")])),
        (
            "runs --json",
            lambda: runs_tool.main([str(root / "outputs"), str(root / "multirun"), "--json"]),
        ),
        (
            "sweep report",
            lambda: [
                render_csv(p := collect_points(runs["sweep"]), "tokens_per_s"),
                render_markdown(p, "tokens_per_s", runs["sweep"]),
                [plot.load_metrics(x["dir"]) for x in p if x.get("dir")],
            ],
        ),
    ]
    return commands


def _refused(fn: Callable[[], Any], *expected: type[BaseException]) -> Callable[[], Any]:
    """``fn``, where raising one of ``expected`` (a clear refusal) counts as ending well."""

    def run() -> Any:
        try:
            return fn()
        except expected as exc:
            print(f"refused: {exc}")
            return None

    return run


def _record_commands(runs: dict[str, Path], root: Path) -> list[tuple[str, Callable[[], Any]]]:
    """The checkpoint tool, ``tune --resume``'s reading of ``tune.json``, ``run_id``, the
    resume command (``overrides.yaml``) and ``multirun.yaml``."""
    from wf_launch.drivers.tune.space import TuneError
    from wf_launch.drivers.tune.state import TuneState
    from wf_launch.readers import checkpoint
    from wf_launch.rundir import files
    from wf_launch.rundir.identity import RunIdError, read_run_id
    from wf_launch.rundir.io import read_yaml
    from wf_launch.rundir.resume import resume_command

    ok, out = runs["ok"], root / "export.pt"
    return [
        ("checkpoint list", lambda: checkpoint.main(["list", str(ok)])),
        ("checkpoint list --json", lambda: checkpoint.main(["list", str(ok), "--json"])),
        (
            "checkpoint export",
            lambda: checkpoint.main(["export", str(ok), "--out", str(out), "--force"]),
        ),
        ("tune --resume reader", _refused(lambda: TuneState.load(runs["tune"]), TuneError)),
        ("run_id", _refused(lambda: print(read_run_id(ok)), RunIdError)),
        ("drill verdict", lambda: _drill_verdict(runs["drill"])),
        ("resume command", lambda: print(resume_command(ok))),
        (
            "multirun.yaml",
            _refused(lambda: read_yaml(runs["sweep"] / files.SWEEP_PLAN), ValueError, OSError),
        ),
    ]


def _drill_verdict(drill_dir: Path) -> None:
    """What the drill reads of its directory once both runs ended: the verdict (the records, the
    attempts, rank 0's metrics, with a tolerance both runs' checkpoints) and its text."""
    from types import SimpleNamespace

    from wf_launch.drivers.drill import Drill, Injection, render, verdict

    injections = [Injection("kill9", 2)]
    for atol in (None, 1e-3):
        drill = Drill([], "local", drill_dir, 10.0, atol=atol)
        runs = [
            SimpleNamespace(
                run_dir=drill_dir / name, overrides=[], launches=1, wall_s=1.0, exit_codes=[0]
            )
            for name in ("reference", "interrupted")
        ]
        print(render(verdict(drill, runs[0], runs[1], injections)))


def _run_one(name: str, fn: Callable[[], Any]) -> tuple[str, str, str]:
    """Run one command: ('ok' | 'crash' | 'hang', detail, what it printed)."""
    out = io.StringIO()
    try:
        with (
            _limit(HANG_CPU_S, HANG_S),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(out),
        ):
            try:
                fn()
            except SystemExit:
                pass
    except _Hang as hang:
        limit = f"{HANG_CPU_S:g} s of CPU" if str(hang) == "CPU" else f"{HANG_S:g} s"
        return "hang", f"{name}: still running after {limit}", out.getvalue()
    except Exception:
        return "crash", f"{name}:\n{traceback.format_exc()}", out.getvalue()
    finally:
        from loguru import logger

        logger.remove()
    return "ok", "", out.getvalue()


@contextlib.contextmanager
def _slurm_shims(where: Path) -> Iterator[Path]:
    """SLURM's commands as shims that fail at once (``scancel`` calls are logged: status must never
    make one)."""
    where.mkdir(parents=True, exist_ok=True)
    for tool in SHIMS:
        (where / tool).write_text(f'#!/bin/sh\necho {tool} "$@" >> {where / "calls"}\nexit 1\n')
        (where / tool).chmod(0o755)
    old = os.environ["PATH"]
    os.environ["PATH"] = f"{where}{os.pathsep}{old}"
    try:
        yield where / "calls"
    finally:
        os.environ["PATH"] = old


def example(rng: random.Random, workdir: Path, report: Callable[[str], None]) -> Counter:
    """Build the templates, damage 1-3 files, run every command; the counts of this example."""
    counts: Counter = Counter()
    runs = build(workdir / "tree")
    outside = workdir / "outside"
    outside.mkdir()
    damaged = []
    for _ in range(rng.randrange(1, 4)):
        files_ = [p for p in _candidates(runs) if p.exists() or p.is_symlink()]
        if not files_:
            break
        choice = rng.random()
        if choice < 0.15:
            path, what = _extra(rng.choice(list(runs.values())), rng)
        elif choice < 0.25:
            path = rng.choice(files_)
            what = link_folder(path, outside)
        else:
            path = rng.choice(files_)
            what = damage(path, rng)
        damaged.append(f"{path.relative_to(workdir)}: {what}")
        counts["files"] += 1
    before = _outside_state(outside)
    for name, fn in _commands(runs, workdir / "tree"):
        outcome, detail, printed = _run_one(name, fn)
        counts[outcome] += 1
        if outcome == "ok":
            outcome, detail = _escaped(name, printed, before, outside)
            counts[outcome] += outcome == "escape"
        if outcome != "ok":
            report(f"--- {outcome} after {'; '.join(damaged)}\n{detail}")
    return counts


def _escaped(name: str, printed: str, before: dict[str, bytes], outside: Path) -> tuple[str, str]:
    """('escape', what) if ``name`` printed a raw control character, read a file out of the
    tree through a link (printed :data:`OUTSIDE_MARKER`) or wrote one; else ('ok', '')."""
    raw = _RAW_CONTROL.search(printed)
    if raw:
        where = printed[max(0, raw.start() - 80) : raw.end() + 20]
        return "escape", f"{name} printed {raw.group()!r} raw: ...{where!r}"
    if OUTSIDE_MARKER in printed:
        return "escape", f"{name} printed a file out of the tree (read through a link)"
    if _outside_state(outside) != before:
        return "escape", f"{name} wrote out of the tree (through a link)"
    return "ok", ""


def run(examples: int, seed: int = 0, report: Callable[[str], None] = print) -> Counter:
    """Try ``examples`` damaged trees; print each failure and the figure."""
    rng = random.Random(seed)
    total: Counter = Counter()
    base = Path(tempfile.mkdtemp(prefix="wf-fuzz-rundirs-"))
    try:
        with _slurm_shims(base / "bin") as calls:
            for n in range(examples):
                workdir = base / f"ex{n}"
                total += example(rng, workdir, report)
                shutil.rmtree(workdir, ignore_errors=True)
            scancels = [
                line
                for line in (calls.read_text().splitlines() if calls.exists() else [])
                if line.startswith("scancel")
            ]
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if "src" in _CHECKPOINT:
            shutil.rmtree(_CHECKPOINT.pop("src"), ignore_errors=True)
    total["scancel"] = len(scancels)
    report(
        f"{total['files']} files tried ({examples} damaged trees, "
        f"{total['ok'] + total['crash'] + total['hang']} "
        f"command runs): {total['crash']} crashes, {total['hang']} hangs, {total['escape']} "
        "escapes "
        f"(raw control characters printed, files read or written through a link out of the "
        f"tree), {total['scancel']} scancel calls"
    )
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    counts = run(args.examples, args.seed)
    return 1 if counts["crash"] or counts["hang"] or counts["escape"] or counts["scancel"] else 0


if __name__ == "__main__":
    sys.exit(main())
