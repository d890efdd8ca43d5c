"""Sweeps resume: ``-m ... hydra.sweep.dir=DIR launcher.resume=true`` reruns only the points that
did not end ok, keeps the others, reports over all of them, and refuses (exit 2, naming what
differs) a directory another sweep made."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_helpers import cli_env, leftover_processes, python_m, run_python_m

pytestmark = pytest.mark.slow
GRID = [
    "task=clockwork",
    "task.modules=[wf_tune_tasks]",
    "task.steps=3",
    "engine.dp_size=1,2",
    "task.micro_batches=1,2",
]


def sweep(
    args: list[str], sweep_dir: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return run_python_m(
        "wf_launch",
        ["-m", *args, f"hydra.sweep.dir={sweep_dir}"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env or cli_env(),
        cwd=sweep_dir.parent,
    )


def rows(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "sweep_summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def test_resume_reruns_only_the_points_that_did_not_end_ok(tmp_path: Path) -> None:
    d = tmp_path / "sweep"
    first = sweep(
        GRID, d, cli_env({"WF_CLOCKWORK_FAIL": "tp1-cp1-pp1-dp2-mb1"})
    )  # point 2 fails this time only
    assert first.returncode == 1, first.stderr
    assert [r["status"] for r in rows(d)] == ["ok", "ok", "failed", "ok"]
    kept = {n: record(d / str(n))["finished_at"] for n in (0, 1, 3)}
    plan = (d / "multirun.yaml").read_text()
    dry = sweep([*GRID, "launcher.resume=true", "launcher.dry_run=true"], d)
    assert dry.returncode == 0, dry.stderr
    assert (
        "rank logs     " in dry.stdout and dry.stdout.count("it ended ok in the earlier sweep") == 3
    )
    assert (d / "multirun.yaml").read_text() == plan and record(d / "2")[
        "status"
    ] == "failed"  # a dry run changes nothing

    again = sweep([*GRID, "launcher.resume=true"], d)
    assert again.returncode == 0, again.stderr
    assert "3 of 4 started point(s) ended ok and are kept" in again.stderr
    assert [r["status"] for r in rows(d)] == ["ok"] * 4  # one report over every point
    for n, finished in kept.items():
        assert record(d / str(n))["finished_at"] == finished  # kept, not rerun
        assert f"kept {d / str(n)}: it ended ok in the earlier sweep" in again.stdout
    rerun = record(d / "2")
    assert rerun["status"] == "ok" and [a["attempt"] for a in rerun["attempts"]] == [0, 1]
    assert (
        d / "2" / "logs" / "result.before-attempt1.json"
    ).is_file()  # the failed record is kept beside it

    refused = sweep([*GRID[:-1], "task.micro_batches=1,2,4", "launcher.resume=true"], d)
    assert refused.returncode == 2, refused.stderr
    assert (
        f"{d} was made by another sweep; what differs:\n  task.micro_batches: 1,2 there, 1,2,4 now"
        in refused.stderr
    )
    reordered = sweep([*GRID[:3], GRID[4], GRID[3], "launcher.resume=true"], d)
    assert (
        reordered.returncode == 2
        and "the order of the overrides (it numbers the points)" in reordered.stderr
    )
    assert [r["status"] for r in rows(d)] == ["ok"] * 4  # nothing ran, nothing moved


def test_an_interrupted_sweep_resumes_its_interrupted_and_unstarted_points(tmp_path: Path) -> None:
    d = tmp_path / "sweep"
    slow = [*GRID[:2], "task.steps=25", "task.unit_s=0.05", *GRID[3:]]
    proc = python_m(
        "wf_launch",
        ["-m", *slow, f"hydra.sweep.dir={d}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        cwd=tmp_path,
        start_new_session=True,
    )
    deadline = time.monotonic() + 90
    while not (d / "1" / "logs" / "rank0.progress.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert [r["status"] for r in rows(d)] == ["ok", "interrupted", "not_run", "not_run"]
    finished = record(d / "0")["finished_at"]

    again = sweep([*slow, "launcher.resume=true"], d)
    assert again.returncode == 0, again.stderr
    assert [r["status"] for r in rows(d)] == ["ok"] * 4
    assert record(d / "0")["finished_at"] == finished
    assert (
        len(record(d / "1")["attempts"]) == 2
    )  # continued in its own directory, as a resumed run does
    assert (
        json.loads((d / "1" / "logs" / "result.before-attempt1.json").read_text())["status"]
        == "interrupted"
    )
    assert leftover_processes(str(d)) == []
