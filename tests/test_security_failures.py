"""A rank's failure stays visible when its record cannot be written; metrics cannot overwrite their
columns, have a cap, and are read as a stream (issue 19, items 12 and 15)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_helpers import result, run_cli

from wf_launch.rank.progress import ProgressReporter
from wf_launch.readers import plot

TASKS = "task.modules=[wf_test_tasks]"


@pytest.mark.slow
def test_a_failure_record_that_cannot_be_written_never_hides_the_root_cause(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(["task=misbehave", TASKS, "task.how=raise_unrecordable", "task.rank=0"], run_dir)
    assert proc.returncode == 1
    log = (run_dir / "logs" / "rank0.log").read_text()
    real, write = (
        log.find("rank 0 failed: ValueError: rank 0 refuses: bad batch 17"),
        log.find("rank 0 could not write its failure record"),
    )
    assert 0 <= real < write, log
    assert (
        "IsADirectoryError" in log[write:] and "its failure is the ValueError above" in log[write:]
    )
    assert (
        "ValueError: rank 0 refuses: bad batch 17" in proc.stderr
    )  # the console shows the real error
    assert "could not write its failure record" in proc.stderr
    assert result(run_dir)["failure"]["rank"] == 0


def test_reserved_metric_names_are_refused(tmp_path: Path) -> None:
    reporter = ProgressReporter(tmp_path, 0, publish_s=0)
    for name in ("rank", "time"):
        with pytest.raises(
            ValueError,
            match=f"'{name}' is a reserved name: every metrics.jsonl line has the "
            r"columns \['rank', 'step', 'time'\]",
        ):
            reporter(1, 10, **{name: 3.0, "loss": 0.5})
    with pytest.raises(TypeError):
        reporter(1, 10, step=3)  # Python refuses it already
    reporter(1, 10, loss=0.5)
    reporter.close()
    assert [
        json.loads(x)["loss"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ] == [0.5]


def test_the_metrics_cap_stops_the_file_and_warns_once(tmp_path: Path) -> None:
    warnings: list[str] = []
    (tmp_path / "logs").mkdir()
    reporter = ProgressReporter(
        tmp_path, 0, publish_s=0, max_metrics_bytes=4096, warn=warnings.append
    )
    for step in range(1, 1000):
        reporter(step, 1000, loss=1.0 / step, lr=3e-4)
    reporter.close()
    size = (tmp_path / "metrics.jsonl").stat().st_size
    assert 4096 <= size < 4096 + 200, size
    assert len(warnings) == 1 and "reached launcher.max_metrics_mb" in warnings[0]
    assert json.loads((tmp_path / "logs" / "rank0.progress.json").read_text())["step"] == 999


def test_metrics_are_streamed_thinned_and_never_block(tmp_path: Path) -> None:
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write("x" * (3 << 20) + "\n")  # a line too long to read: skipped
        for step in range(3 * plot.MAX_POINTS):
            f.write(json.dumps({"rank": 0, "step": step, "time": 1.0, "loss": float(step)}) + "\n")
        f.write('{"rank": "x", "step": 1, "loss": 2}\n[1, 2]\n{"step": true, "loss": 1}\n')
    series = plot.load_metrics(tmp_path)
    points = series["loss"][0]
    assert plot.MAX_POINTS // 2 <= len(points) <= plot.MAX_POINTS
    assert points[0] == (0, 0.0) and points[-1][0] >= 3 * plot.MAX_POINTS - 8
    os.unlink(tmp_path / "metrics.jsonl")
    os.mkfifo(tmp_path / "metrics.jsonl")
    assert plot.load_metrics(tmp_path) == {}
