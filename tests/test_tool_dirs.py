"""A tune or drill directory is the owner's and a tune record is data (issue 29, item 2):
``--resume`` never runs a stored command, every field of ``tune.json`` is checked, the directory
is owner-only and one tune (or drill) at a time holds it."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import cli_env, run_python_m

from wf_launch.drivers.tune.space import TuneError, build_space
from wf_launch.drivers.tune.state import TuneState
from wf_launch.rundir import files
from wf_launch.rundir.claim import claim_tool_dir

CLOCKWORK = ["task=clockwork", "task.modules=[wf_tune_tasks]", "task.unit_s=0.01"]
ARGS = {
    "world_size": 1,
    "overrides": CLOCKWORK,
    "also": [["task.micro_batches", ["1", "2"]]],
    "mem_gb": None,
    "metric": "tokens_per_s",
    "warmup": 1,
    "min_steps": 2,
    "cutoff": 0.0,
    "steps_field": "steps",
    "settings": {"budget_s": None, "stall_s": 60.0},
}


def record(directory: Path) -> dict[str, Any]:
    """A tune interrupted in its first round, as the tuner writes it."""
    axes = [(k, v) for k, v in ARGS["also"]]
    space = [p.to_json() | {"verdict": {"status": "valid"}} for p in build_space(1, axes)]
    ids = [p["id"] for p in space]
    state = TuneState(directory, copy.deepcopy(ARGS), full_length=4, space=space)
    state.rounds = [{"index": 0, "steps": 3, "trials": ids, "status": "interrupted"}]
    state.status = "interrupted"
    directory.mkdir(mode=0o700, exist_ok=True)
    state.save()
    return json.loads((directory / files.TUNE_STATE).read_text())


def write(directory: Path, data: dict[str, Any]) -> None:
    (directory / files.TUNE_STATE).write_text(json.dumps(data))


def tune(args: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return run_python_m(
        "wf_launch.tune",
        [*args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(),
        cwd=cwd,
    )


def test_resume_rebuilds_the_round_command_and_never_runs_a_stored_one(tmp_path: Path) -> None:
    d = tmp_path / "tune"
    data = record(d)
    marker = tmp_path / "ran"
    data["rounds"][0]["argv"] = ["/bin/sh", "-c", f"touch {marker}"]
    write(d, data)
    proc = tune(["--resume", str(d)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not marker.exists()
    state = json.loads((d / files.TUNE_STATE).read_text())
    assert state["status"] == "done" and state["winner"] in {p["id"] for p in state["space"]}
    assert all("argv" not in r for r in state["rounds"][1:])
    assert (d.stat().st_mode & 0o777) == 0o700


def _tamper(path: str, value: Any) -> Any:
    def apply(data: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node: Any = data
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[int(leaf) if leaf.isdigit() else leaf] = value

    return apply


@pytest.mark.parametrize(
    "change, field",
    [
        (_tamper("space.0.id", "/tmp/outside"), "space[0].id"),
        (_tamper("space.0.label", "mb=1\nhydra:\n  run: {dir: /}"), "space[0].label"),
        (_tamper("space.0.overrides", ["hydra.run.dir=/tmp"]), "space[0].overrides"),
        (_tamper("space.0.verdict.status", "great"), "space[0].verdict.status"),
        (_tamper("args.overrides", ["hydra.sweep.dir=/tmp/x"]), "hydra.sweep.dir"),
        (_tamper("args.overrides", ["--config-dir=/tmp"]), "not a Hydra override"),
        (_tamper("args.world_size", 1e999), "args.world_size"),
        (_tamper("args.world_size", "1"), "args.world_size"),
        (_tamper("args.warmup", -1), "args.warmup"),
        (_tamper("args.cutoff", 7), "args.cutoff"),
        (_tamper("args.metric", "a b"), "args.metric"),
        (_tamper("args.also", [["task.micro_batches", ["1\n2"]]]), "args.also[0]"),
        (_tamper("launcher", "local; rm -rf"), "launcher"),
        (_tamper("rounds.0.steps", 10**6), "rounds[0].steps"),
        (_tamper("rounds.0.trials", ["../../etc"]), "rounds[0].trials"),
        (_tamper("rounds.0.index", 3), "rounds[0].index"),
        (_tamper("rounds.0.status", 5), "rounds[0].status"),
        (_tamper("rounds.0.argv", "sh"), "rounds[0].argv"),
        (_tamper("winner", "t99"), "winner"),
        (_tamper("sessions", "2"), "sessions"),
        (_tamper("elapsed_s", float("nan")), "elapsed_s"),
        (_tamper("measurements", [{"trial": "t00-tp1-cp1-pp1-dp1-micro_batches1"}]), "round"),
        (_tamper("rounds", {}), "rounds"),
    ],
)
def test_every_field_of_the_record_is_checked(tmp_path: Path, change: Any, field: str) -> None:
    data = record(tmp_path / "tune")
    TuneState.load(tmp_path / "tune")  # the untouched record loads
    change(data)
    write(tmp_path / "tune", data)
    with pytest.raises(TuneError) as err:
        TuneState.load(tmp_path / "tune")
    assert field in str(err.value) and "tune.json" in str(err.value)
    assert "\n" not in str(err.value).split(": ", 1)[0]


def test_a_record_others_could_write_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "tune"
    record(d)
    os.chmod(d, 0o775)
    proc = tune(["--resume", str(d)], tmp_path, timeout=60)
    assert proc.returncode == 2 and "mode 0775" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    os.chmod(d, 0o700)
    os.chmod(d / files.TUNE_STATE, 0o664)
    proc = tune(["--resume", str(d)], tmp_path, timeout=60)
    assert proc.returncode == 2 and "mode 0664" in proc.stderr


def test_a_second_tune_in_the_same_directory_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "tune"
    record(d)
    with claim_tool_dir(d, "--dir"):  # a live tune holds it
        resumed = tune(["--resume", str(d)], tmp_path, timeout=60)
    assert resumed.returncode == 2 and "in use by a live launch" in resumed.stderr
    with claim_tool_dir(tmp_path / "other", "--dir"):
        second = tune([*CLOCKWORK, "world_size=1", "--dir", str(tmp_path / "other")], tmp_path)
    assert second.returncode == 2 and "in use by a live launch" in second.stderr
    assert (tmp_path / "other").stat().st_mode & 0o777 == 0o700


def test_a_drill_directory_is_owner_only_and_held_by_one_drill(tmp_path: Path) -> None:
    d = tmp_path / "drill"
    args = ["task=train", "task.steps=4", "task.checkpoint_every=2", "--inject", "kill9@3"]
    with claim_tool_dir(d, "--dir"):
        proc = run_python_m(
            "wf_launch.drill",
            [*args, "--dir", str(d)],
            capture_output=True,
            text=True,
            timeout=120,
            env=cli_env(),
            cwd=tmp_path,
        )
    assert proc.returncode == 2 and "in use by a live launch" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert d.stat().st_mode & 0o777 == 0o700
