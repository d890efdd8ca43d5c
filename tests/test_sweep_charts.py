"""The sweep report's pictures: a scaling chart when the world size varies, metrics over steps per
point."""

from __future__ import annotations

from pathlib import Path

from wf_launch.rank.progress import ProgressReporter
from wf_launch.readers.sweep import collect_points, write_report
from wf_launch.rundir.files import SWEEP_SCALING as SCALING_NAME
from wf_launch.rundir.files import SWEEP_STEPS as STEPS_NAME
from wf_launch.rundir.record import RunRecord, Status

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _point(sweep: Path, job: int, world: int, tps: float, steps: int) -> None:
    job_dir = sweep / str(job)
    (job_dir / "logs").mkdir(parents=True)
    layout = {"tp": 1, "cp": 1, "pp": 1, "dp": world, "order": "tp-cp-pp-dp", "world_size": world}
    RunRecord(
        Status.OK,
        run_dir=str(job_dir),
        layout=layout,
        final=True,
        overrides=[f"engine.dp_size={world}"],
        results={"0": {"tokens_per_s": tps}},
        timings={"wall_s": 1.0},
    ).write()
    rep = ProgressReporter(job_dir, 0)
    for step in range(steps):
        rep(step, steps, loss=2.0 / (1 + step * world / 4))
    rep.close()


def test_scaling_and_steps_charts_come_with_the_report(tmp_path: Path) -> None:
    for job, (world, tps) in enumerate([(1, 1000.0), (2, 1900.0), (4, 3500.0), (8, 6000.0)]):
        _point(tmp_path, job, world, tps, 40)
    written = write_report(tmp_path, collect_points(tmp_path))
    for key, name in (("scaling", SCALING_NAME), ("steps", STEPS_NAME)):
        assert written[key] == tmp_path / name
        data = (tmp_path / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_no_scaling_chart_when_the_world_size_does_not_vary(tmp_path: Path) -> None:
    _point(tmp_path, 0, 2, 100.0, 0)
    _point(tmp_path, 1, 2, 120.0, 0)
    written = write_report(tmp_path, collect_points(tmp_path))
    assert "scaling" not in written and "steps" not in written and "png" in written
