"""``python -m wf_launch.runs``: every run and sweep point, newest first, never crashing on a bad
record."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from cli_helpers import run_python_m

from wf_launch.rundir.record import RunRecord, Status

REPO = Path(__file__).resolve().parents[1]
LAYOUT = {"tp": 1, "cp": 2, "pp": 2, "dp": 1, "order": "tp-cp-pp-dp", "world_size": 4}


def _run(path: Path, when: float, status: Status | None, **facts: object) -> Path:
    path.mkdir(parents=True)
    if status is not None:
        RunRecord(status, run_dir=str(path), final=True, finished_at=when, **facts).write()  # type: ignore[arg-type]
    else:
        (path / "config.yaml").write_text(
            "engine: {tp_size: 1, cp_size: 1, pp_size: 1, dp_size: 2}\n"
        )
    os.utime(path, (when, when))
    return path


def _runs(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_python_m(
        "wf_launch.runs",
        [*args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_runs_are_listed_newest_first_with_layout_launcher_and_metric(tmp_path: Path) -> None:
    _run(
        tmp_path / "outputs/d/a",
        1000,
        Status.OK,
        task="demo",
        launcher="local",
        layout=LAYOUT,
        timings={"wall_s": 1.5},
        results={"0": {"tokens_per_s": 1234.5, "ok": True}},
    )
    _run(
        tmp_path / "outputs/d/b",
        3000,
        Status.FAILED,
        task="misbehave",
        launcher="slurm",
        layout=LAYOUT,
        extra={"slurm": {"job_id": "77"}},
        results={},
    )
    bad = _run(tmp_path / "outputs/d/c", 2000, Status.OK)
    (bad / "result.json").write_text('{"status": "ok", "res')
    _run(tmp_path / "outputs/d/e", 4000, None)
    sweep = tmp_path / "multirun/d/s"
    sweep.mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    _run(sweep / "0", 500, Status.INVALID, failure={"cause": "invalid_config", "message": "x"})

    proc = _runs(cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:4] == ["when", "status", "task", "tp/cp/pp/dp"]
    order = [line.split()[2] for line in lines[1:] if not line.startswith("    ")]
    assert order == ["running", "failed", "unreadable", "ok", "invalid"]
    failed = next(line for line in lines if " failed " in line)
    assert "slurm 77" in failed and "1/2/2/1" in failed
    ok = next(line for line in lines if " ok " in line)
    assert "tokens_per_s=1234" in ok and "1.50" in ok and "local" in ok
    assert any("outputs/d/c/result.json" in line and "truncated" in line for line in lines)

    only = json.loads(_runs("--status", "failed", "--json", cwd=tmp_path).stdout)
    assert [r["status"] for r in only] == ["failed"] and only[0]["launcher"] == "slurm 77"
    points = json.loads(_runs(str(tmp_path / "multirun"), "--json", cwd=tmp_path).stdout)
    assert len(points) == 1 and points[0]["sweep"] == str(sweep)


def test_no_runs_is_not_an_error_and_a_missing_dir_is(tmp_path: Path) -> None:
    assert _runs(cwd=tmp_path).returncode == 0
    missing = _runs(str(tmp_path / "nope"), cwd=tmp_path)
    assert missing.returncode == 2 and "not a directory" in missing.stderr
