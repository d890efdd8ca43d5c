"""``python -m wf_launch.plot``: metrics over steps from metrics.jsonl, rendered and checked as a PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from wf_launch.rank.progress import ProgressReporter
from wf_launch.readers.chart_limits import MAX_DRAWN, MAX_LINES, MAX_PANELS, cap
from wf_launch.readers.plot import load_metrics

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _plot(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "wf_launch.plot", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_metrics_are_plotted_per_step(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    reps = [ProgressReporter(tmp_path, r) for r in range(2)]
    for step in range(50):
        for r, rep in enumerate(reps):
            rep(step, 50, loss=1.0 / (1 + step + r), lr=1e-3)
    for rep in reps:
        rep.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"rank": 0, "step": 3, "loss": NaN}\n{"truncated\n')
    series = load_metrics(tmp_path)
    assert (
        sorted(series) == ["loss", "lr"]
        and len(series["loss"][0]) == 50
        and len(series["loss"][1]) == 50
    )

    proc = _plot(str(tmp_path), "loss", "--all-ranks")
    assert proc.returncode == 0, proc.stderr
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000


def test_missing_metrics_are_a_clear_error(tmp_path: Path) -> None:
    none = _plot(str(tmp_path))
    assert none.returncode == 2 and "no metrics in" in none.stderr
    (tmp_path / "logs").mkdir()
    rep = ProgressReporter(tmp_path, 0)
    rep(1, loss=0.5)
    rep.close()
    wrong = _plot(str(tmp_path), "acc")
    assert (
        wrong.returncode == 2 and "no metric 'acc'" in wrong.stderr and "['loss']" in wrong.stderr
    )


def _timed_plot(run: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = _plot(str(run))
    return proc, time.perf_counter() - start


def test_a_line_of_thousands_of_metrics_is_capped_and_said(tmp_path: Path) -> None:
    """One 41 KB line of 3,000 metrics once took plot over 300 s and 7.4 GB: now it draws the
    first metrics only, says so on the console and in the chart, and ends about as fast as a
    one-metric plot (a ratio measured in this run, never an absolute time)."""
    small, big = tmp_path / "small", tmp_path / "big"
    for run, row in (
        (small, {"rank": 0, "step": 1, "loss": 0.5}),
        (big, {"rank": 0, "step": 1, **{f"m{i:04d}": i / 7 for i in range(3000)}}),
    ):
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    assert (big / "metrics.jsonl").stat().st_size > 40_000
    small_proc, small_s = _timed_plot(small)
    assert small_proc.returncode == 0, small_proc.stderr
    big_proc, big_s = _timed_plot(big)
    assert big_proc.returncode == 0, big_proc.stderr
    assert f"{MAX_PANELS} of 3000 metrics drawn" in big_proc.stderr
    assert big_s < 6 * small_s, (big_s, small_s)
    assert (big / "metrics.png").read_bytes()[:8] == PNG_MAGIC


def test_long_lines_are_thinned_and_said(tmp_path: Path) -> None:
    series = {
        "loss": {f"run {i}": [(s, float(s)) for s in range(5 * MAX_DRAWN)] for i in range(40)}
    }
    capped, notes = cap(series)
    lines = capped["loss"]
    assert len(lines) == MAX_LINES and all(len(p) <= MAX_DRAWN for p in lines.values())
    assert lines["run 0"][0] == (0, 0.0) and lines["run 0"][-1][0] == 5 * MAX_DRAWN - 1
    assert notes == [
        f"at most {MAX_LINES} lines drawn per metric",
        f"lines thinned to at most {MAX_DRAWN} points",
    ]
