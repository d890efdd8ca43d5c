"""One run directory holds one run: relaunches are refused, overwrite moves the old run aside."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import cli_env, result, run_cli, start_cli, wait_for_log

pytestmark = pytest.mark.slow
TASKS = "task.modules=[wf_test_tasks]"


def _files(run_dir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and ".hydra" not in p.parts and p.name != ".wf_launch.lock"
    }


def test_a_second_launch_into_a_finished_run_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert run_cli(["task=noop", "engine.dp_size=2"], run_dir).returncode == 0
    before = _files(run_dir)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700

    again = run_cli(["task=noop"], run_dir)
    assert again.returncode == 2
    assert f"run directory {run_dir} already holds a run (status 'ok'" in again.stderr
    assert "launcher.overwrite=true" in again.stderr

    invalid = run_cli(["task=noop", "engine.cp_size=0"], run_dir)
    assert invalid.returncode == 2 and "already holds a run" in invalid.stderr

    dry = run_cli(["task=noop", "engine.cp_size=0", "launcher.dry_run=true"], run_dir)
    assert dry.returncode == 2 and "engine.cp_size=0 is not allowed" in dry.stderr
    assert _files(run_dir) == before


def test_overwrite_moves_the_old_run_aside_and_starts_clean(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    failed = run_cli(
        ["task=misbehave", TASKS, "task.how=raise", "task.rank=1", "engine.dp_size=2"], run_dir
    )
    assert failed.returncode == 1 and (run_dir / "logs" / "rank1.error.json").exists()
    proc = run_cli(["task=noop", "launcher.overwrite=true"], run_dir)
    assert proc.returncode == 0, proc.stderr
    res = result(run_dir)
    assert res["status"] == "ok" and set(res["results"]) == {"0"} and "failure" not in res
    assert not (run_dir / "logs" / "rank1.error.json").exists()
    assert "bad batch 17" not in (run_dir / "logs" / "rank0.log").read_text()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and result(aside[0])["status"] == "failed"
    assert (aside[0] / "logs" / "rank1.error.json").exists()


def test_a_live_launch_owns_its_run_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = start_cli(
        ["task=misbehave", TASKS, "task.how=sleep_all", "task.sleep_s=120", "engine.dp_size=2"],
        run_dir,
    )
    try:
        wait_for_log(run_dir / "logs" / "rank0.log", "sleeping")
        second = run_cli(["task=noop", "launcher.overwrite=true"], run_dir)
        assert second.returncode == 2
        assert (
            f"run directory {run_dir} is in use by a live launch (pid {first.pid})" in second.stderr
        )
    finally:
        os.killpg(first.pid, signal.SIGINT)
        first.communicate(timeout=120)
    assert first.returncode == 130
    assert result(run_dir)["status"] == "interrupted"


def test_a_sweep_directory_holds_one_sweep(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"

    def sweep(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "wf_launch",
                "-m",
                "task=noop",
                *extra,
                f"hydra.sweep.dir={sweep_dir}",
            ],
            capture_output=True,
            text=True,
            timeout=180,
            env=cli_env(),
            cwd=tmp_path,
        )

    assert sweep("engine.dp_size=1,2,4").returncode == 0
    again = sweep("engine.dp_size=1,2")
    assert (
        again.returncode == 2
        and f"sweep directory {sweep_dir} already holds a sweep" in again.stderr
    )
    time.sleep(1)
    replaced = sweep("engine.dp_size=1,2", "launcher.overwrite=true")
    assert replaced.returncode == 0, replaced.stderr
    rows = (sweep_dir / "sweep_summary.csv").read_text().splitlines()
    assert len(rows) == 3, rows
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("sweep.replaced-")]) == 1
