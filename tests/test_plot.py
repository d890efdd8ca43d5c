"""``python -m wf_launch.plot``: metrics over steps from metrics.jsonl, rendered and checked as a
PNG."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from cli_helpers import run_python_m

from wf_launch.rank.progress import ProgressReporter
from wf_launch.readers.plot import load_metrics

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _plot(*args: str) -> subprocess.CompletedProcess:
    return run_python_m(
        "wf_launch.plot",
        [*args],
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
