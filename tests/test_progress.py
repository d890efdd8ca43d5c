"""Progress: ranks report cheaply, the launcher makes one line of it and names a stalled rank."""

from __future__ import annotations

import json
import time
from pathlib import Path

from wf_launch.observe.progress import ProgressMonitor, ProgressView
from wf_launch.rank.progress import ProgressReporter
from wf_launch.rundir.files import METRICS as METRICS_FILE
from wf_launch.rundir.progress import read_progress


def _label(rank: int) -> str:
    return f"r{rank} tp0 cp{rank % 2} pp0 dp{rank // 2}"


def test_reporters_publish_and_append_metrics(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    reps = [ProgressReporter(tmp_path, r, publish_s=0.0) for r in range(4)]
    for step in range(1, 11):
        for r, rep in enumerate(reps):
            if r == 3 and step > 6:
                continue
            rep(step, 10, loss=1.0 / step) if r == 0 else rep(step, 10)
    for rep in reps:
        rep.close()
    states = read_progress(tmp_path, 4)
    assert {r: s["step"] for r, s in states.items()} == {0: 10, 1: 10, 2: 10, 3: 6}
    lines = [json.loads(x) for x in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert (
        len(lines) == 10
        and lines[-1]["rank"] == 0
        and lines[-1]["step"] == 10
        and lines[-1]["loss"] == 0.1
    )

    view = ProgressView(tmp_path, 4, _label, stall_warning_s=60)
    snap = view.snapshot()
    assert snap is not None and snap["slowest"] == 3 and snap["step"] == 6
    line = view.line(snap)
    assert (
        line.startswith("step 6/10 (60%)")
        and "slowest rank 3 (tp0 cp1 pp0 dp1)" in line
        and "loss=0.1" in line
    )


def test_a_rank_without_progress_is_named_once(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    a, b = (
        ProgressReporter(tmp_path, 0, publish_s=0.0),
        ProgressReporter(tmp_path, 1, publish_s=0.0),
    )
    a(5, 100)
    b(340, 1000)
    view = ProgressView(tmp_path, 2, _label, stall_warning_s=100)
    snap = view.snapshot()
    later = time.time() + 120
    assert view.stalls(snap, later) == [
        "rank 0 (tp0 cp0 pp0 dp0): no progress for 120 s, last at step 5",
        "rank 1 (tp0 cp1 pp0 dp0): no progress for 120 s, last at step 340",
    ]
    assert view.stalls(snap, later + 10) == []


def test_monitor_prints_plain_lines_off_a_terminal(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    rep = ProgressReporter(tmp_path, 0, publish_s=0.0)
    seen: list[str] = []
    monitor = ProgressMonitor(
        ProgressView(tmp_path, 1, _label), interval_s=0.0, write=seen.append, tty=False, poll_s=0.05
    ).start()
    for step in range(1, 6):
        rep(step, 5, loss=float(step))
        time.sleep(0.1)
    monitor.stop()
    assert seen and seen[-1].startswith("step 5/5 (100%)") and "loss=5" in seen[-1]


def test_progress_calls_are_cheap_next_to_writing_the_metrics_line(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    rep = ProgressReporter(tmp_path, 0)
    n = 20_000
    t0 = time.perf_counter()
    for step in range(n):
        rep(step, n)
    bare = time.perf_counter() - t0
    with open(tmp_path / "baseline.jsonl", "a", buffering=1) as f:
        t0 = time.perf_counter()
        for step in range(n):
            f.write(json.dumps({"rank": 0, "step": step, "time": time.time(), "loss": 0.5}) + "\n")
        baseline = time.perf_counter() - t0
    t0 = time.perf_counter()
    for step in range(n):
        rep(step, n, loss=0.5)
    with_metrics = time.perf_counter() - t0
    assert bare < baseline * 1.5, (bare, baseline)
    assert with_metrics < baseline * 3, (with_metrics, baseline)
