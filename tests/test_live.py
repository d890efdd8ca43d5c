"""The live view any launcher shows: scheduler state on change, console ranks' lines, progress, one
final line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from cli_helpers import run_python_m

from wf_launch.observe.live import LiveView, console_shows, final_line
from wf_launch.rank.progress import ProgressReporter
from wf_launch.rundir.outcome import RunOutcome
from wf_launch.rundir.record import RunRecord, Status


def _run_dir(path: Path, console: list[int] | None) -> Path:
    (path / "logs").mkdir(parents=True)
    config = {
        "engine": {"cp_size": 2, "dp_size": 1},
        "launcher": {"console_ranks": console, "progress_interval_s": 0, "stall_warning_s": 300},
    }
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    return path


def _log(run_dir: Path, rank: int, message: str, newline: bool = True) -> None:
    with open(run_dir / "logs" / f"rank{rank}.log", "a") as f:
        f.write(
            f"2026-01-01 00:00:00.000 | INFO    | [r{rank} tp0 cp{rank} pp0 dp0] task:run:3 | "
            f"{message}" + ("\n" if newline else "")
        )


def test_state_changes_console_lines_and_progress_are_shown_once_each(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path / "run", console=[0])
    states = iter(
        [
            ("Q job 7", "PENDING (Priority)"),
            ("Q job 7", "PENDING (Priority)"),
            ("Q job 7", "RUNNING on n1"),
            None,
        ]
    )
    seen: list[str] = []
    view = LiveView([run_dir], seen.append, state_of=lambda d: next(states))
    view.tick()
    _log(run_dir, 0, "hello")
    _log(run_dir, 1, "not a console rank")
    _log(run_dir, 0, "half a line", newline=False)
    view.tick()
    ProgressReporter(run_dir, 0, publish_s=0)(3, 10, loss=0.5)
    view.tick()
    view.tick()
    view.close()
    assert seen[:3] == [
        "Q job 7: PENDING (Priority)",
        "[r0 tp0 cp0 pp0 dp0] hello",
        "Q job 7: RUNNING on n1",
    ]
    assert any(
        line.startswith("step 3/10 (30%)") and "1/2 ranks reporting" in line and "loss=0.5" in line
        for line in seen
    ), seen
    assert not any("not a console rank" in line or "half a line" in line for line in seen), seen


def test_a_sweep_shows_states_per_point_only(tmp_path: Path) -> None:
    runs = [_run_dir(tmp_path / str(i), console=None) for i in range(2)]
    _log(runs[0], 0, "hello")
    seen: list[str] = []
    view = LiveView(runs, seen.append, state_of=lambda d: ("Q job 9", f"RUNNING on n{d.name}"))
    view.tick()
    view.tick()
    view.close()
    assert seen == ["Q job 9 (0): RUNNING on n0", "Q job 9 (1): RUNNING on n1"]


def test_final_line_is_status_wall_time_and_record_path(tmp_path: Path) -> None:
    record = RunRecord.finalize(tmp_path, Status.FAILED, timings={"wall_s": 12.3456})
    assert (
        final_line(RunOutcome.of(record, tmp_path))
        == f"run failed in 12.35s: {tmp_path / 'result.json'}"
    )
    assert (
        final_line(RunOutcome(Status.CANCELLED, tmp_path))
        == f"run cancelled: {tmp_path} (no record)"
    )


def test_attaching_shows_only_the_last_lines_already_written_then_new_ones(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path / "run", console=[0])
    for i in range(5000):
        _log(run_dir, 0, f"old {i}")
    seen: list[str] = []
    view = LiveView([run_dir], seen.append, backlog=3)
    view.tick()
    _log(run_dir, 0, "new")
    view.tick()
    view.close()
    assert seen == [f"[r0 tp0 cp0 pp0 dp0] old {i}" for i in (4997, 4998, 4999)] + [
        "[r0 tp0 cp0 pp0 dp0] new"
    ]


def _dead_local_run(path: Path) -> Path:
    """A local run whose launcher was killed: config.yaml and a lock naming a pid that no longer
    lives."""
    import subprocess

    run_dir = _run_dir(path, console=[0])
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["launcher"]["name"] = "local"
    config["task"] = {"name": "ticker"}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    gone = subprocess.Popen(["true"])
    gone.wait()
    (run_dir / ".wf_launch.lock").write_text(f"{gone.pid}\n")
    _log(run_dir, 0, "last words")
    return run_dir


def test_a_killed_local_launch_ends_follow_and_is_listed_unknown(tmp_path: Path) -> None:
    import json

    run_dir = _dead_local_run(tmp_path / "outputs" / "run")
    follow = run_python_m(
        "wf_launch.status",
        ["--follow", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert follow.returncode == 3, follow.stderr
    assert "[r0 tp0 cp0 pp0 dp0] last words" in follow.stderr
    assert (
        f"run unknown: {run_dir} (no record)" in follow.stderr
        and "is gone and left no final record" in follow.stderr
    )
    runs = run_python_m(
        "wf_launch.runs",
        [str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = json.loads(runs.stdout)
    assert [(r["status"], r["task"], r["launcher"]) for r in rows] == [
        ("unknown", "ticker", "local")
    ], rows
    assert "launcher is gone" in rows[0]["problem"]


def test_a_streamed_rank_log_shows_what_the_ranks_console_would(tmp_path: Path) -> None:
    """Its failure (kept for the file) and its traceback, and DEBUG lines, are not streamed."""
    code = """
import sys
from pathlib import Path
from wf_launch.rank.ranklog import FILE_ONLY, setup_rank_logging
log = setup_rank_logging(Path(sys.argv[1]), 0, "r0", False, capture_prints=False)
log.info("step 1")
try:
    raise ValueError("bad batch 17")
except ValueError as exc:
    log.bind(**{FILE_ONLY: True}).opt(exception=exc).error("rank 0 failed: ValueError")
log.debug("detail")
log.warning("after")
"""
    path = tmp_path / "rank0.log"
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=120)
    shown, previous = [], True
    for line in path.read_text().splitlines():
        previous = console_shows(line, previous)
        shown += [line.rpartition(" | ")[2]] if previous else []
    assert "Traceback (most recent call last):" in path.read_text()
    assert shown == ["step 1", "after"]
