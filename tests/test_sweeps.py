"""Multirun sweeps over layouts through the real CLI: every point runs, the report tells them
apart."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import (
    cli_env,
    leftover_processes,
    popen_argv,
    run_argv,
    run_python_m,
    wait_for_log,
)

pytestmark = pytest.mark.slow
TASKS = "task.modules=[wf_test_tasks]"
TINY_DEMO = [
    "task=demo",
    "task.frames=2",
    "task.height=8",
    "task.width=8",
    "task.hidden=16",
    "task.depth=2",
    "task.warmup=0",
    "task.repeats=1",
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _sweep_cmd(args: list[str], sweep_dir: Path) -> list[str]:
    return [sys.executable, "-m", "wf_launch", "-m", *args, f"hydra.sweep.dir={sweep_dir}"]


def run_sweep(
    args: list[str], sweep_dir: Path, timeout: float = 120
) -> subprocess.CompletedProcess:
    """``python -m wf_launch -m ARGS hydra.sweep.dir=SWEEP_DIR`` to completion."""
    return run_argv(
        _sweep_cmd(args, sweep_dir),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(),
        cwd=sweep_dir.parent,
    )


def summary_rows(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "sweep_summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_sweep_runs_every_point_and_reports_invalid_and_failed_ones(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_sweep(
        [
            "engine.cp_size=1,0,2",
            "task=misbehave",
            TASKS,
            "task.how=raise",
            "task.rank=1",
            "hydra.callbacks.sweep_report.metric=wall_s",
        ],
        sweep,
    )
    assert proc.returncode == 1, proc.stderr
    rows = summary_rows(sweep)
    assert [(r["job"], r["status"], r["cp"], r["world"]) for r in rows] == [
        ("0", "ok", "1", "1"),
        ("1", "invalid", "0", "0"),
        ("2", "failed", "2", "2"),
    ]
    assert rows[1]["failure"] == "engine.cp_size=0 is not allowed: expected an integer >= 1"
    assert (
        rows[2]["failure"] == "rank 1 (tp0 cp1 pp0 dp0): ValueError: rank 1 refuses: bad batch 17"
    )
    assert float(rows[0]["wall_s"]) > 0 and float(rows[2]["wall_s"]) > 0 and rows[1]["wall_s"] == ""
    assert "engine.cp_size=0" in rows[1]["overrides"]
    for num, status in ((0, "ok"), (1, "invalid"), (2, "failed")):
        res = json.loads((sweep / str(num) / "result.json").read_text())
        assert res["status"] == status and res["run_dir"] == str(sweep / str(num))
    assert sorted(p.name for p in (sweep / "2" / "logs").glob("rank*.log")) == [
        "rank0.log",
        "rank1.log",
    ]
    assert not (sweep / "1" / "logs").exists()
    for num in (0, 2):  # a second launch in the same process still forks (no lingering threads)
        assert "start method fork" in (sweep / str(num) / "launcher.log").read_text()
    md = (sweep / "sweep_summary.md").read_text()
    assert (
        "3 point(s): 1 ok, 1 invalid, 1 failed" in md
        and "- `sweep_chart.png`: wall_s per point" in md
    )
    assert (sweep / "sweep_chart.png").read_bytes().startswith(PNG_MAGIC)
    assert "sweep report (1 ok, 1 invalid, 1 failed)" in proc.stderr
    assert leftover_processes(str(sweep)) == []


def test_demo_layout_sweep_reports_metrics_and_regenerates_offline(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_sweep(["engine.cp_size=1,2", "engine.pp_size=1,2", *TINY_DEMO], sweep)
    assert proc.returncode == 0, proc.stderr
    rows = summary_rows(sweep)
    assert [(r["cp"], r["pp"], r["world"], r["status"]) for r in rows] == [
        ("1", "1", "1", "ok"),
        ("1", "2", "2", "ok"),
        ("2", "1", "2", "ok"),
        ("2", "2", "4", "ok"),
    ]
    assert all(float(r["tokens_per_s"]) > 0 and float(r["max_abs_err"]) < 1e-4 for r in rows)
    assert list(rows[0])[9] == "tokens_per_s"  # the charted metric leads the metric columns
    md = (sweep / "sweep_summary.md").read_text()
    assert "4 point(s): 4 ok" in md and "tokens_per_s" in md and "| 1/2/2/1 |" in md
    assert (sweep / "sweep_chart.png").read_bytes().startswith(PNG_MAGIC)

    for name in ("sweep_summary.csv", "sweep_summary.md", "sweep_chart.png"):
        (sweep / name).unlink()
    offline = run_python_m(
        "wf_launch.sweep_report",
        [str(sweep), "--metric", "max_abs_err"],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
    )
    assert offline.returncode == 0, offline.stderr
    assert [(r["job"], r["status"], r["tokens_per_s"]) for r in summary_rows(sweep)] == [
        (r["job"], r["status"], r["tokens_per_s"]) for r in rows
    ]
    assert list(summary_rows(sweep)[0])[9] == "max_abs_err"
    assert (
        "- `sweep_chart.png`: max_abs_err per point\n" in (sweep / "sweep_summary.md").read_text()
    )
    assert (sweep / "sweep_chart.png").read_bytes().startswith(PNG_MAGIC)


def test_interrupt_stops_the_sweep_and_still_reports(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = popen_argv(
        _sweep_cmd(
            [
                "engine.cp_size=1,2,4",
                "task=misbehave",
                TASKS,
                "task.how=sleep_all",
                "task.sleep_s=60",
            ],
            sweep,
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        wait_for_log(sweep / "0" / "logs" / "rank0.log", "sleeping")
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert [(r["job"], r["status"]) for r in summary_rows(sweep)] == [
        ("0", "interrupted"),
        ("1", "not_run"),
        ("2", "not_run"),
    ]
    assert not (sweep / "1").exists()
    assert leftover_processes(str(sweep)) == []


def test_offline_report_names_a_missing_sweep_dir(tmp_path: Path) -> None:
    proc = run_python_m(
        "wf_launch.sweep_report",
        [str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
    )
    assert proc.returncode == 2
    assert f"sweep directory '{tmp_path / 'nope'}' does not exist" in proc.stderr
